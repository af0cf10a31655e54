"""dflash completion: the shell's completion script for `dflash`, printed or installed
(docs/cli.md "Shell completion")."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import click
from click.shell_completion import get_completion_class

from ..completion import COMPLETE_VAR, PROG, SHELLS
from ..errors import DflashError, ExitCode
from ..local_state import write_atomic


@dataclasses.dataclass(frozen=True)
class Installed:
    """Where --install put the script, and the start-up file that reads it (None for
    fish, which reads its completions folder by itself)."""
    shell: str
    script: Path
    startup_file: Path | None
    line_added: bool  # False: the start-up file read the script already


def chosen_shell(shell: str | None) -> str:
    """--shell, else the login shell's name ($SHELL)."""
    name = shell or os.path.basename(os.environ.get("SHELL", ""))
    if name not in SHELLS:
        raise DflashError(f"no completion for the shell {name or '(SHELL is not set)'!r}: dflash completes in "
                          f"{', '.join(SHELLS)}", ExitCode.USAGE, hint="name one: dflash completion --shell bash")
    return name


def script(group: click.Group, shell: str) -> str:
    """click's completion script for `dflash` in `shell`: it asks `dflash` itself, with
    _DFLASH_COMPLETE set, for the words at each Tab."""
    return get_completion_class(shell)(group, {}, PROG, COMPLETE_VAR).source()


def _places(shell: str) -> tuple[Path, Path | None]:
    """(where the script goes, the start-up file that sources it)."""
    home = Path.home()
    data = Path(os.environ.get("XDG_DATA_HOME") or home / ".local" / "share")
    if shell == "fish":
        config = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
        return config / "fish" / "completions" / f"{PROG}.fish", None
    return data / "dflash" / f"completion.{shell}", home / (".bashrc" if shell == "bash" else ".zshrc")


def install(group: click.Group, shell: str) -> Installed:
    """The script written to a file of its own and one line that sources it added to the
    shell's start-up file, once: a new shell completes without starting dflash at its
    start (an `eval "$(dflash completion)"` there would, every time)."""
    path, startup = _places(shell)
    write_atomic(path, script(group, shell).encode())
    if startup is None:
        return Installed(shell, path, None, False)
    line = f"[ -f {_quoted(path)} ] && . {_quoted(path)}  # dflash completion"
    try:
        text = startup.read_text()
    except FileNotFoundError:
        text = ""
    if line in text.splitlines():
        return Installed(shell, path, startup, False)
    # Appended, not replaced: a start-up file is often a link into a dotfiles checkout,
    # which a rename would turn into a plain file.
    with open(startup, "a") as fh:
        fh.write(("" if text.endswith("\n") or not text else "\n") + line + "\n")
    return Installed(shell, path, startup, True)


def _quoted(path: Path) -> str:
    return "'" + str(path).replace("'", "'\\''") + "'"


@dataclasses.dataclass(frozen=True)
class Script:
    """The completion script of `shell`, for the shell to evaluate."""
    shell: str
    script: str


def completion(group: click.Group, *, shell: str | None = None, do_install: bool = False) -> Script | Installed:
    """The script (`shell`, default: $SHELL's), or with `do_install` where it went."""
    name = chosen_shell(shell)
    return install(group, name) if do_install else Script(name, script(group, name))
