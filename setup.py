"""The build step pyproject.toml cannot say: a wheel carries what dflash deploys.

An installed (non-editable) dflash has no checkout to deploy from, so the wheel holds
dflash_cli/_release/ with the files a release of this tree lists (remote/ and
configs/: same paths, bytes and modes, hence the same release id). An editable
install deploys its checkout and gets no copy.
"""
import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildPyWithRelease(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        sys.path.insert(0, str(HERE))  # this tree's scan, not an installed dflash's
        from dflash_cli import release

        bundled = Path(self.build_lib) / "dflash_cli" / "_release"
        shutil.rmtree(bundled, ignore_errors=True)  # a stale copy from an earlier build
        for entry in release.scan(HERE).files:
            target = bundled / entry.path
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(HERE / entry.path, target)
            target.chmod(entry.mode)


setup(cmdclass={"build_py": BuildPyWithRelease})
