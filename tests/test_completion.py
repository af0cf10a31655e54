"""Shell completion (docs/cli.md "Shell completion"): `dflash completion --install` puts
click's script where a new bash reads it, and that bash, through the real `dflash`
command, completes run ids and names from logs/ and hosts from the inventory."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from dflash_run import dflash, dflash_in_process

from dflash_cli.completion import COMPLETE_VAR
from dflash_cli.local_state import RunRef, set_latest

BIN = Path(sys.executable).parent  # the venv's bin/, which holds the `dflash` command


def _environment(home: Path, extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, "HOME": str(home), "XDG_DATA_HOME": str(home / ".local" / "share"),
            "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", **extra}


def bash_completes(home: Path, words: list[str], env: dict[str, str]) -> list[str]:
    """What a bash that read ~/.bashrc offers at the end of `words` (a Tab there)."""
    script = (". ~/.bashrc\n"
              f"COMP_WORDS=({' '.join(words)}); COMP_CWORD={len(words) - 1}\n"
              "_dflash_completion dflash  # as bash calls it: the command is $1\n"
              'printf "%s\\n" "${COMPREPLY[@]}"\n')
    done = subprocess.run(["bash", "--norc", "-c", script], capture_output=True, text=True, timeout=120,
                          env=_environment(home, env))
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_installed_completion_offers_run_ids_names_and_hosts(make_inventory, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("export SOMETHING_OF_MINE=1")  # no newline at its end
    logs = tmp_path / "logs"
    set_latest(logs, RunRef("node", "tiny-cpu-20261204-150000-aaaa"))
    set_latest(logs, RunRef("node", "exp-20261204-160000-bbbb"))
    hosts = make_inventory(tmp_path)
    env = {"DFLASH_LOGS": str(logs), "DFLASH_HOSTS": str(hosts)}
    for _ in range(2):  # a second install finds its line there
        installed = dflash("completion", "--install", "--shell", "bash", env=_environment(home, {}))
        assert installed.returncode == 0, installed.stderr
    rc = (home / ".bashrc").read_text()
    assert rc.startswith("export SOMETHING_OF_MINE=1\n") and rc.count("dflash completion") == 1
    assert (home / ".local" / "share" / "dflash" / "completion.bash").is_file()

    assert bash_completes(home, ["dflash", "sta"], env) == ["stacks", "status"]
    assert bash_completes(home, ["dflash", "status", "ti"], env) == ["tiny-cpu-20261204-150000-aaaa", "tiny-cpu"]
    assert bash_completes(home, ["dflash", "watch", "--host", "no"], env) == ["node"]
    assert bash_completes(home, ["dflash", "launch", "ct20"], env) == ["ct200", "ct201"]


def test_completion_prints_the_script_and_its_variable_works_under_every_command_name(tmp_path):
    printed = dflash_in_process("completion", "--shell", "zsh")
    assert printed.returncode == 0 and "compdef _dflash_completion dflash" in printed.stdout
    assert f"{COMPLETE_VAR}=zsh_complete" in printed.stdout
    set_latest(tmp_path / "logs", RunRef("local", "exp-20261204-160000-bbbb"))
    for command in ("dflash", "dflash-trainer"):
        done = subprocess.run([str(BIN / command)], capture_output=True, text=True, timeout=120,
                              env={**os.environ, COMPLETE_VAR: "bash_complete", "COMP_WORDS": f"{command} stop e",
                                   "COMP_CWORD": "2"})
        assert done.stdout.splitlines() == ["plain,exp-20261204-160000-bbbb", "plain,exp"], done.stderr
