"""This project and Z Lab's `dflash` (PyPI's `dflash`: the reference DFlash inference
code, import package `dflash`, console script `dflash = dflash.cli:main`) installed into
one environment, offline, in either order: the distributions, import packages and files
collide nowhere but in the one `bin/dflash` both declare, which belongs to the package
installed last; `dflash-trainer` and `python -m dflash_cli` are always this project's,
and either package uninstalled leaves the other whole (docs/cli.md "Install").

Z Lab's side is a stand-in built here with its distribution name, module and entry
point (its code is not this project's to ship)."""
from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from dflash_cli import DISTRIBUTION
from support.checkout import build_wheel

pytestmark = pytest.mark.timeout(300)
API_PACKAGE = "dflash_trainer"  # this project's Python API (docs/api.md)
STAND_IN = {
    "pyproject.toml": ('[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
                       '[project]\nname = "dflash"\nversion = "0.1.0"\n'
                       '[project.scripts]\ndflash = "dflash.cli:main"\n'
                       '[tool.setuptools]\npackages = ["dflash"]\n'),
    "dflash/__init__.py": 'WHOSE = "z-lab stand-in"\n',
    "dflash/cli.py": "def main():\n    print('z-lab dflash stand-in')\n",
}


def run(*argv: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "NO_COLOR": "1"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)
    assert not ok or done.returncode == 0, f"{argv} failed:\n{done.stdout}\n{done.stderr}"
    return done


def pip(venv: Path, *args: str) -> None:
    run(sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "--python",
        str(venv / "bin" / "python"), *args, "-q")


def stand_in_wheel(folder: Path) -> Path:
    for name, text in STAND_IN.items():
        (folder / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / "src" / name).write_text(text)
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w",
        str(folder / "dist"), str(folder / "src"))
    (wheel,) = (folder / "dist").glob("dflash-0.1.0-*.whl")
    return wheel


def venv_with(folder: Path, *wheels: Path) -> Path:
    """A fresh venv with `wheels` installed in order (no dependencies: this interpreter's
    packages, click and the rest, are reached through a .pth written after them)."""
    run(sys.executable, "-m", "venv", "--without-pip", str(folder))
    for wheel in wheels:
        pip(folder, "install", "--no-deps", "--no-index", str(wheel))
    site = run(str(folder / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    Path(site.stdout.strip(), "outer-packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return folder


def installed_files(wheel: Path) -> set[str]:
    """What the wheel puts in site-packages, its metadata folder aside."""
    names = zipfile.ZipFile(wheel).namelist()
    return {name for name in names if ".dist-info/" not in name}


def entry_points(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
        return archive.read(name).decode()


def whose_dflash(venv: Path) -> str:
    return run(str(venv / "bin" / "dflash"), "--version").stdout


@pytest.mark.slow(seconds=25, why="builds this project's wheel and a stand-in's, installs them into three virtualenvs")
def test_ours_and_z_labs_dflash_share_one_environment_in_either_order(tmp_path):
    ours = build_wheel(tmp_path / "ours")
    theirs = stand_in_wheel(tmp_path / "theirs")
    assert ours.name.startswith(f"{DISTRIBUTION.replace('-', '_')}-0.1.0-")
    tops = {name.split("/")[0] for name in installed_files(ours)}
    assert API_PACKAGE in tops and "dflash_cli" in tops
    assert not installed_files(ours) & installed_files(theirs)  # no module or file in common
    assert "dflash = dflash_cli.entry:main" in entry_points(ours)
    assert "dflash-trainer = dflash_cli.entry:main" in entry_points(ours)

    for order in ((ours, theirs), (theirs, ours)):
        venv = venv_with(tmp_path / f"venv {order[0].name.split('-')[0]} first", *order)
        imported = run(str(venv / "bin" / "python"), "-c",
                       f"import dflash, {API_PACKAGE}; print(dflash.WHOSE); print({API_PACKAGE}.__version__); "
                       f"print(callable({API_PACKAGE}.launch))")
        assert imported.stdout.splitlines() == ["z-lab stand-in", "0.1.0", "True"]
        ours_command = run(str(venv / "bin" / "dflash-trainer"), "--version")
        assert ours_command.stdout.startswith("dflash 0.1.0\nrelease ")
        module = run(str(venv / "bin" / "python"), "-m", "dflash_cli", "--version")
        assert module.stdout == ours_command.stdout
        # `bin/dflash` is the one file both declare: the package installed last owns it.
        if order[-1] is theirs:
            assert whose_dflash(venv) == "z-lab dflash stand-in\n"
        else:
            assert whose_dflash(venv) == ours_command.stdout

    # Either uninstalled leaves the other whole (bar `bin/dflash` when the other wrote it last).
    venv = venv_with(tmp_path / "venv both", ours, theirs)
    pip(venv, "uninstall", "-y", "dflash")
    assert run(str(venv / "bin" / "dflash-trainer"), "--version").stdout.startswith("dflash 0.1.0\n")
    gone = run(str(venv / "bin" / "python"), "-c", "import dflash", ok=False)
    assert "No module named 'dflash'" in gone.stderr
    venv = venv_with(tmp_path / "venv again", theirs, ours)
    pip(venv, "uninstall", "-y", DISTRIBUTION)
    assert run(str(venv / "bin" / "python"), "-c", "import dflash; print(dflash.WHOSE)").stdout == "z-lab stand-in\n"
