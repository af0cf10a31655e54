"""The tables of `runs` and `status` fit the terminal: at 80 columns the least important
columns are left out (and named under the table) instead of every header being cut to
`chang…`; the run (or host), its state and step always stay; at 200 every column shows."""
from __future__ import annotations

import io

import pytest
from rich.console import Console

from dflash_cli.commands.status import hosts_table, runs_table
from dflash_cli.multihost import HostStatus
from dflash_cli.tables import FittedTable
from dflash_contract.records import ReleaseSource
from dflash_contract.replies import RunStatus
from dflash_contract.states import RunState
from dflash_run import dflash_in_process
from support_agent.harness import agent  # noqa: F401  (fixture)

RUNS = ["tiny-cpu-20260101-120000-ab12", "tiny-cpu-20260101-110000-cd34", "tiny-cpu-20260101-100000-ef56"]
RUN_HEADERS = ["run", "state", "step", "errors", "started", "ended", "release", "source", "changed since previous run"]

SOURCE = ReleaseSource(kind="checkout", path="/src/dflash", release_id="6c8bbc43f3bbfdb8", dflash_version=None,
                       git_commit="1a2b3c4d5e6f", dirty=True, diff_sha256="ab" * 32, modified=("configs/x.yaml",))


def run_status(run_id: str, state: RunState, step: int | None, startup: str | None = None) -> RunStatus:
    return RunStatus(run_id=run_id, name="tiny-cpu", state=state, reason=None, pid=1, started_at=1764430000.0,
                     ended_at=1764430100.0 if state.terminal else None, exit=None, errors=0, last_heartbeat=None,
                     release_id="6c8bbc43f3bbfdb8", source=SOURCE, overrides=(),
                     step=step, startup=startup, startup_elapsed_s=12.0 if startup else None, peer_failure=None,
                     attempt=0, attempts=1, resume_step=None, checkpoint_step=None, export=None)


def drawn(table: FittedTable, width: int) -> str:
    out = io.StringIO()
    Console(file=out, width=width, no_color=True, force_terminal=False).print(table)
    return out.getvalue()


def header_and_caption(text: str) -> tuple[str, str]:
    """The header rows' text (between the top edge and the rule under them) and the
    caption under the table."""
    lines = text.splitlines()
    top = next(i for i, line in enumerate(lines) if line.startswith("┏"))
    rule = next(i for i, line in enumerate(lines) if line.startswith("┡"))
    bottom = next(i for i, line in enumerate(lines) if line.startswith("└"))
    return " ".join(lines[top + 1:rule]), " ".join(lines[bottom + 1:])


def check_fits(text: str, width: int, headers: list[str], kept: list[str]) -> list[str]:
    """No line wider than `width`, nothing cut with an ellipsis, every header either whole
    in the header rows (its words, in order, in its column) or named under the table;
    `kept` among the shown. Returns the headers shown."""
    assert "…" not in text, text
    assert max(map(len, text.splitlines())) <= width, text
    header, caption = header_and_caption(text)
    cells = [" ".join(cell.split()) for cell in header.split("┃")]
    shown = []
    for name in headers:
        words = name.split()
        if all(any(word in cell.split() for cell in cells) for word in words):
            shown.append(name)
        else:
            assert name in " ".join(caption.split()), (name, text)
    assert set(kept) <= set(shown), text
    return shown


def runs() -> list[RunStatus]:
    return [run_status(RUNS[0], RunState.RUNNING, None, "build train step drafter 0 (cold)"),
            run_status(RUNS[1], RunState.SUCCEEDED, 120), run_status(RUNS[2], RunState.FAILED, 3)]


CHANGES = {RUNS[0]: {"text": f"changed since {RUNS[1]}: 2 files (+14 −3)"}, RUNS[1]: {"text": f"same release as {RUNS[2]}"}}


def test_the_runs_table_leaves_out_columns_by_priority_at_80_and_shows_all_at_200():
    narrow = drawn(runs_table("runs on local", runs(), CHANGES), 80)
    shown = check_fits(narrow, 80, RUN_HEADERS, ["run", "state", "step"])
    assert shown == ["run", "state", "step", "errors", "source"]  # the most important, in their order
    assert all(run_id in narrow for run_id in RUNS)  # never cut: it names the run
    assert "left out for want of width: started, ended, release, changed since previous run" in " ".join(narrow.split())
    wide = drawn(runs_table("runs on local", runs(), CHANGES), 200)
    assert check_fits(wide, 200, RUN_HEADERS, RUN_HEADERS) == RUN_HEADERS
    assert "left out" not in wide and "2 files (+14 −3)" in wide
    one = drawn(runs_table(f"run {RUNS[0]} on local", runs()[:1]), 80)  # `status RUN`'s
    check_fits(one, 80, RUN_HEADERS[:7], ["run", "state", "step"])


@pytest.mark.parametrize("width", [80, 200])
def test_the_hosts_table_of_a_run_on_several_hosts_keeps_host_state_and_step(width):
    statuses = [HostStatus("ct200", 0, RUNS[0], run_status(RUNS[0], RunState.RUNNING, 7)),
                HostStatus("ct202", 1, RUNS[0], None, error="host ct202: cannot connect (connection refused)")]
    text = drawn(hosts_table(f"run {RUNS[0]} on 2 hosts: UNKNOWN", statuses), width)
    headers = ["host", "state", "step", "errors", "started", "ended", "release"]
    shown = check_fits(text, width, headers, ["host", "state", "step"])
    assert shown == (headers if width == 200 else ["host", "state", "step", "errors", "release"])
    assert "6c8bbc43f3bbfdb8" in text  # a release id is never folded
    assert all(word in text.split() for word in "ct202: cannot connect (connection refused)".split())  # why not


@pytest.mark.parametrize("columns", [80, 200])
def test_runs_and_status_at_the_terminals_width(agent, make_inventory, tmp_path, columns):  # noqa: F811
    for run_id in reversed(RUNS):
        agent.launch(run_id, [{"print": "done"}])
    for run_id in RUNS:
        agent.wait_state(run_id, "SUCCEEDED")
    hosts = make_inventory(tmp_path, local={"workspace": str(agent.workspace)})
    listed = dflash_in_process("runs", "--host", "local", hosts=hosts, env={"COLUMNS": str(columns)})
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout == "".join(f"local\t{run_id}\tSUCCEEDED\n" for run_id in RUNS)
    shown = check_fits(listed.stderr, columns, RUN_HEADERS, ["run", "state", "step"])
    assert len(shown) == (len(RUN_HEADERS) if columns == 200 else 5)
    status = dflash_in_process("status", RUNS[0], "--host", "local", hosts=hosts, env={"COLUMNS": str(columns)})
    assert status.returncode == 0 and status.stdout == "SUCCEEDED\n", status.stderr
    check_fits(status.stderr, columns, RUN_HEADERS[:7], ["run", "state", "step"])
