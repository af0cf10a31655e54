"""Fixtures shared by the whole suite: a real OpenSSH sshd on 127.0.0.1, a fake Proxmox
node with a strict `pct`, and an inventory writer for them (tests/support/).

`make test` runs the suite on several pytest-xdist workers (processes); what keeps them apart:
- a session fixture is built once per worker, under that worker's own tmp_path_factory
  folder: state that must be one per worker goes there, never in a fixed path
  (~/.ssh, /tmp/NAME, the checkout) unless it is written atomically and means the same to
  every worker (test_export's transformers 4.57.1 in the user's cache folder);
- ports come from support.free_port(s) (the kernel's choice), never a fixed number;
- a test finds the processes it must check or end by its own paths or pids (its
  tmp_path in their argv, run.json), never by a name that another worker's process has too.
The suite runs with `--dist loadgroup`: tests marked `@pytest.mark.xdist_group("NAME")` run
on one worker. Mark so the tests that share an expensive module fixture (a trained run),
so that it is made once, and any test that cannot follow the rules above."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

# Every process of the suite, here or on a test host, runs with support.inventory.HOST_ENV
# (it says why each variable is set); set before anything imports torch, which reads them.
from support.inventory import HOST_ENV  # noqa: E402

os.environ.update(HOST_ENV)
# xdist's workers inherit COLUMNS=80 and LINES=24 from execnet; rich fixes a console's width
# from COLUMNS when the console is made, so whichever test imported dflash_cli.console first
# would pin every later in-process CLI call of that worker to 80 columns. Without them, as
# in a plain pytest run, a test's own COLUMNS applies to its call.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)
# A suite started as a background job of a shell without job control (`make test &` in a
# script) inherits SIGINT ignored, and so would every process it starts: the tests that
# press Ctrl-C on `dflash watch` would wait for an exit that never comes. Python's handler
# is put back; exec gives a handled signal its default action in the children.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

from support import FakePve, SshNode, make_fake_pve, start_sshd, stop_sshd, write_inventory  # noqa: E402
from support.checkout import REPO, added_since, untracked_entries  # noqa: E402
from support.pve import NeedsRoot  # noqa: E402
from support.sshd import SshdMissing  # noqa: E402
from support.train_configs import TINY_CPU  # noqa: E402
from support.trainer import Launched, end, start_trainer  # noqa: E402


@pytest.fixture(scope="session")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trainer's workspace for the whole session: its tiny-target cache is built once."""
    path = tmp_path_factory.getbasetemp() / "dflash-workspace"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_cpu_run(workspace: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launched]:
    """configs/train/tiny-cpu.yaml as shipped, run to its end by the real trainer (started as
    the agent starts it, in a new interpreter): what `make demo` runs. test_trainer_runs
    checks the run and test_speculative decodes with its drafter; their tests that use it are
    in xdist group "tiny-cpu-run", so it is made once. The caller checks its exit status."""
    run = start_trainer(workspace, tmp_path_factory.mktemp("tiny-cpu") / "run", TINY_CPU.read_text(),
                        "tiny-cpu", fresh=True)
    try:
        run.wait(400)
        yield run
    finally:
        end(run)


@pytest.fixture(scope="session")
def ssh_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshNode]:
    """A real sshd on 127.0.0.1 (root logs in with `identity_file`; its key is in
    `known_hosts`), stopped at the end of the session."""
    try:
        node, proc = start_sshd(tmp_path_factory.mktemp("sshd"))
    except SshdMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield node
    finally:
        stop_sshd(proc)


@pytest.fixture(scope="session")
def fake_pve(tmp_path_factory: pytest.TempPathFactory) -> FakePve:
    """The node's fake pct: containers 200 and 202 running, 201 stopped, 999 unknown."""
    try:
        return make_fake_pve(tmp_path_factory.mktemp("pve") / "pve node")
    except NeedsRoot as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An interpreter with the standard library only (a fresh venv): what a host whose
    python lacks torch and transformers has."""
    venv = tmp_path_factory.mktemp("bare venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return str(venv / "bin" / "python")


@pytest.fixture(scope="session")
def bare_container(fake_pve: FakePve, bare_python: str) -> int:
    """Container 203 of the fake node: running, its `python3` the bare interpreter (a
    fresh container with only the system Python)."""
    return fake_pve.add_bare_container(Path(bare_python).parent)


@pytest.fixture(scope="session")
def gpu_container(fake_pve: FakePve, tmp_path_factory: pytest.TempPathFactory) -> int:
    """Container 204 of the fake node: running, with a fake nvidia-smi on its PATH that
    answers the agent's query with four H200s of 143771 MiB."""
    return fake_pve.add_gpu_container(tmp_path_factory.mktemp("gpu bin"))


@pytest.fixture
def make_inventory(ssh_node: SshNode, fake_pve: FakePve) -> Iterator[Callable[..., Path]]:
    """make_inventory(tmp_path, **overrides) -> path of a hosts.yaml with hosts local,
    node, ct200, ct201, ct999 and down (see support/inventory.py for overrides).

    After the test, the node's side of the containers' mount point must still be
    empty: a file there was written on the node instead of inside a container."""

    def make(tmp_path: Path, /, **overrides: dict[str, Any] | None) -> Path:
        return write_inventory(tmp_path, ssh_node, fake_pve, **overrides)

    yield make
    leaks = fake_pve.node_leaks()
    for leak in leaks:  # removed, so that the tests after this one start clean
        path = fake_pve.mount_point / leak
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    assert not leaks, f"written on the node instead of inside the container: {fake_pve.mount_point}/{leaks}"


@pytest.fixture(autouse=True)
def logs_outside_the_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's default logs folder is `logs` in the project root, the checkout when the
    suite runs: every test gets its own instead (DFLASH_LOGS is --logs-dir's
    variable), so no test writes into the checkout."""
    monkeypatch.setenv("DFLASH_LOGS", str(tmp_path / "logs"))


CHECKOUT_BEFORE = pytest.StashKey["set[str] | None"]()
CHECKOUT_ADDED = pytest.StashKey["list[str]"]()


def pytest_sessionstart(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):  # the controller's, or a run without workers
        session.config.stash[CHECKOUT_BEFORE] = untracked_entries()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The suite fails if it left a file in the checkout (a test's logs/, a download, …):
    checked once, when every worker is done."""
    if CHECKOUT_BEFORE in session.config.stash:
        added = session.config.stash[CHECKOUT_ADDED] = added_since(session.config.stash[CHECKOUT_BEFORE])
        if added:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    added = config.stash.get(CHECKOUT_ADDED, [])
    if added:
        terminalreporter.write_line(f"error: the tests left these in the checkout {REPO}: {', '.join(added)}",
                                    red=True)


@pytest.fixture(scope="session", autouse=True)
def ssh_client_config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An empty client config made for the tests: dflash (and its subprocesses) resolve
    SSH targets with it instead of the machine's ~/.ssh/config (DFLASH_SSH_CONFIG is
    OpenSSH's `ssh -F`). Tests that need a config of their own set the variable again."""
    path = tmp_path_factory.mktemp("ssh-client") / "config"
    path.write_text("")
    yield from _variable_set("DFLASH_SSH_CONFIG", path)


def _variable_set(name: str, path: Path) -> Iterator[Path]:
    """A session fixture's body: `name` set to `path` for its life, then as it was."""
    before = os.environ.get(name)
    os.environ[name] = str(path)
    yield path
    if before is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = before


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test marked slow says what it costs and why: @pytest.mark.slow(seconds=N, why="...")
    (`make test-fast` leaves them out); a test of tiny_cpu_run is one.

    The slow tests run first, the longest first (the order is otherwise kept): a worker
    takes the next test of the queue when it is almost out of work, so a long test queued
    late would still be running when the other workers have finished everything. A module
    fixture that slow tests outside an xdist_group share is session-scoped: this order
    puts the module's other tests elsewhere in the queue."""
    for item in items:
        if "tiny_cpu_run" in getattr(item, "fixturenames", ()) and item.get_closest_marker("slow") is None:
            raise pytest.UsageError(f"{item.nodeid}: it uses tiny_cpu_run, the shipped tiny config's whole run: "
                                    "mark it slow")
        for mark in item.iter_markers("slow"):
            seconds, why = mark.kwargs.get("seconds"), mark.kwargs.get("why")
            if mark.args or set(mark.kwargs) != {"seconds", "why"} or not isinstance(seconds, (int, float)) \
                    or not isinstance(why, str) or not why:
                raise pytest.UsageError(f"{item.nodeid}: a slow test states its cost and why: "
                                        "@pytest.mark.slow(seconds=N, why='...')")
    items.sort(key=lambda item: -stated_seconds(item))


def stated_seconds(item: pytest.Item) -> float:
    mark = item.get_closest_marker("slow")
    return 0 if mark is None else mark.kwargs["seconds"]
