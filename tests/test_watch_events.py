"""The run's events come home with `watch` (stand-in trainer, tests/support_agent): the
local events.jsonl holds each event once across a dropped connection and a watch killed
before it saved its cursor; TensorBoard's own reader finds every scalar of every step
once; on a terminal a status line is kept below the log; `plot` draws the events."""
from __future__ import annotations

import json
import os
import pty
import select
import signal
import struct
import subprocess
import termios
import fcntl
import time
from pathlib import Path

import pytest

from dflash_run import dflash_argv, dflash_env
from support import kill_ssh_sessions
from support_agent.harness import agent  # noqa: F401  (fixture)
from support.wait import wait_until
from test_watch_log import Watch

pytestmark = pytest.mark.timeout(180)

TOTAL_STEPS = 6


def step_event(step: int) -> dict:
    """A step event as the trainer writes it (two drafters, the second on CPU)."""
    return {"type": "step", "step": step, "total_steps": TOTAL_STEPS, "loss": 4.0 - step / 4,
            "acc": [0.1 * step, 0.05 * step, 0.01], "lr": 1e-4 * step, "grad_norm": 2.0 / step, "epoch": 0,
            "samples_per_s": 10.0 + step, "tokens_per_s": 100.0 * step, "peak_memory_bytes": [step * 2 ** 30, None]}


def events_script(first: int, last: int) -> list[dict]:
    script = []
    for step in range(first, last + 1):
        script += [{"event": step_event(step)}, {"heartbeat": step}, {"print": f"[drafter-0] step {step}"}]
    return script


@pytest.fixture
def hosts(agent, make_inventory, tmp_path):  # noqa: F811
    workspace = {"workspace": str(agent.workspace)}
    return make_inventory(tmp_path, local=workspace, node=workspace)


def host_events(run_dir: Path) -> list[dict]:
    """The host's events.jsonl as `follow` sends it: every record but heartbeats."""
    records = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return [r for r in records if r["type"] != "heartbeat"]


def tensorboard_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} as TensorBoard itself reads the folder."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reader = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    reader.Reload()
    return {tag: [(s.step, s.value) for s in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}


def test_events_reach_the_mirror_and_tensorboard_once_across_drops_and_a_lost_cursor(
        agent, hosts, ssh_node, tmp_path):  # noqa: F811
    agent.launch("ev", [*events_script(1, 3), {"touch": "a"}, {"wait_file": "go"},
                        {"event": {"type": "checkpoint", "step": 3, "path": "checkpoints/step_000003"}},
                        {"event": {"type": "eval", "step": 3, "acceptance_length": 1.75, "mean_per_prompt": 1.5}},
                        *events_script(4, TOTAL_STEPS)])
    run_dir = agent.run_dir("ev")
    logs = tmp_path / "logs"
    mirror = logs / "node" / "ev"
    watch = Watch(hosts, logs, "ev", "--host", "node", "--retry-for", "60")
    watch.wait_out(b"step 3\n")
    wait_until(lambda: (mirror / "events.jsonl").exists() and (mirror / "events.jsonl").read_text().count("\n") == 3,
             60, "the first three step events mirrored")
    assert kill_ssh_sessions(ssh_node)
    agent.touch("ev", "go")
    assert watch.finish() == 0, watch.stderr.decode()
    assert "reconnecting" in watch.stderr.decode()
    sent = host_events(run_dir)
    assert [json.loads(line) for line in (mirror / "events.jsonl").read_text().splitlines()] == sent

    # A watch killed after writing the mirror and TensorBoard, before saving its cursor:
    # the next one finds the cursor behind, cuts the mirror back and receives the rest again.
    cursor = json.loads((mirror / "cursor.json").read_text())
    host_lines = (run_dir / "events.jsonl").read_bytes().splitlines(keepends=True)
    kept = [line for line in host_lines if json.loads(line)["type"] != "heartbeat"][:2]
    cursor.update(events_offset=sum(map(len, host_lines[:host_lines.index(kept[-1]) + 1])),
                  events_mirrored=sum(len(json.dumps(json.loads(line)) + "\n") for line in kept))
    (mirror / "cursor.json").write_text(json.dumps(cursor))
    again = Watch(hosts, logs, "ev", "--host", "node")
    assert again.finish() == 0, again.stderr.decode()
    assert [json.loads(line) for line in (mirror / "events.jsonl").read_text().splitlines()] == sent

    # TensorBoard's reader: every scalar of every step, once, with the value sent.
    scalars = tensorboard_scalars(mirror)
    steps = list(range(1, TOTAL_STEPS + 1))
    expected = {"train/loss": "loss", "train/lr": "lr", "train/grad_norm": "grad_norm", "train/epoch": "epoch",
                "throughput/samples_per_s": "samples_per_s", "throughput/tokens_per_s": "tokens_per_s"}
    for tag, field in expected.items():
        assert scalars[tag] == [(s, pytest.approx(step_event(s)[field])) for s in steps], tag
    assert scalars["train/acc@1"] == [(s, pytest.approx(step_event(s)["acc"][0])) for s in steps]
    for position in (1, 2, 3):
        assert scalars[f"train/acc_by_position/{position}"] == [
            (s, pytest.approx(step_event(s)["acc"][position - 1])) for s in steps]
    assert scalars["memory/peak_gib/drafter-0"] == [(s, pytest.approx(s)) for s in steps]
    assert "memory/peak_gib/drafter-1" not in scalars  # null: a CPU drafter has no counter
    assert scalars["eval/acceptance_length"] == [(3, 1.75)]
    assert scalars["eval/mean_per_prompt"] == [(3, 1.5)]


def read_terminal(fd: int, proc: subprocess.Popen, until: bytes, timeout: float = 60) -> bytes:
    """Everything the terminal received until `until` appears or the process ended."""
    seen = b""
    deadline = time.monotonic() + timeout
    while until not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                seen += os.read(fd, 65536)
            except OSError:  # EIO: the process closed the terminal
                break
        elif proc.poll() is not None:
            break
    return seen


def test_on_a_terminal_a_status_line_stays_below_the_scrolling_log(agent, hosts, tmp_path):  # noqa: F811
    agent.launch("tty", [*events_script(1, 4), {"event": {"type": "eval", "step": 4, "acceptance_length": 2.25}},
                         {"print": "[coordinator] four steps done"}, {"wait_file": "go0"},
                         {"print": "[coordinator] waiting"}, {"wait_file": "go"},
                         *events_script(5, TOTAL_STEPS)])
    logs = tmp_path / "logs"
    earlier = Watch(hosts, logs, "tty", "--host", "local")  # not on a terminal: no status line
    earlier.wait_out(b"four steps done")
    mirrored = logs / "local" / "tty" / "events.jsonl"
    wait_until(lambda: mirrored.exists() and "acceptance_length" in mirrored.read_text(), 60, "the eval mirrored")
    agent.touch("tty", "go0")
    earlier.wait_out(b"waiting")  # shown after the events before it were handled whole
    earlier.proc.send_signal(signal.SIGINT)
    assert earlier.finish() == 130
    assert b"ETA" not in earlier.stderr and b"\x1b[" not in earlier.stderr
    # Resumed on a terminal: the status shows where the run is (from the events mirrored
    # before), although no event comes until the run goes on.
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
    env = dict(dflash_env(), TERM="xterm-256color", COLUMNS="200")
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen(dflash_argv("--logs-dir", str(logs), "watch", "tty", "--host", "local",
                                        hosts=hosts), stdin=terminal, stdout=terminal, stderr=terminal, env=env,
                            start_new_session=True)
    os.close(terminal)
    try:
        screen = read_terminal(controller, proc, b"accept 2.25")
        assert b"step 4/6" in screen and b"loss 3.0000" in screen and b"acc@1 0.400" in screen, screen
        assert b"14.0 samples/s" in screen and b"ETA 00:00:" in screen, screen
        agent.touch("tty", "go")
        screen += read_terminal(controller, proc, b"ended: SUCCEEDED")
        assert proc.wait(timeout=60) == 0
        # Updated in place: the line is erased and redrawn, not printed again below.
        assert b"\x1b[2K" in screen, screen
        assert b"step 6/6" in screen and b"ETA 00:00:00" in screen, screen[-2000:]
        log_at = screen.rindex(b"[drafter-0] step 6")
        assert screen.index(b"step 6/6") > log_at, "the status follows the log line it summarises"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(controller)


def test_not_on_a_terminal_no_status_line_and_json_carries_the_events(agent, hosts, tmp_path):  # noqa: F811
    agent.launch("pipe", events_script(1, 2))
    plain = Watch(hosts, tmp_path / "logs", "pipe", "--host", "local")
    assert plain.finish() == 0
    assert plain.stdout == (agent.run_dir("pipe") / "train.log").read_bytes()
    assert b"ETA" not in plain.stderr and b"\x1b[" not in plain.stderr
    as_json = Watch(hosts, tmp_path / "other-logs", "pipe", "--host", "local", "--json")
    assert as_json.finish() == 0
    messages = [json.loads(line) for line in as_json.stdout.splitlines()]
    events = [e for m in messages if m["t"] == "events" for e in m["events"]]
    assert events == host_events(agent.run_dir("pipe"))


def test_plot_draws_every_run_s_loss_acceptance_and_throughput_from_the_mirrors(tmp_path):
    from click.testing import CliRunner

    from dflash_cli.cli import main
    from dflash_cli.commands import plot
    from dflash_cli.local_state import RunRef

    logs = tmp_path / "logs"
    runs = {RunRef("ct200", "a"): [step_event(s) for s in (1, 2, 3)],
            RunRef("gpu1", "b"): [step_event(s) for s in (1, 2)]}
    runs[RunRef("ct200", "a")].insert(2, {"type": "eval", "step": 2, "acceptance_length": 1.5})
    for ref, events in runs.items():
        (logs / ref.host / ref.run_id).mkdir(parents=True)
        (logs / ref.host / ref.run_id / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    fig = plot.figure(plot.load(logs, list(runs)))
    loss, acceptance, throughput = fig.axes
    drawn = {ax.get_ylabel(): {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
                               for line in ax.get_lines()} for ax in fig.axes}
    assert drawn["loss"] == {"ct200/a": ([1, 2, 3], [3.75, 3.5, 3.25]), "gpu1/b": ([1, 2], [3.75, 3.5])}
    assert drawn["acceptance length"] == {"ct200/a": ([2], [1.5]), "gpu1/b": ([], [])}
    assert drawn["throughput (tokens/s)"]["ct200/a"] == ([1, 2, 3], [100.0, 200.0, 300.0])
    assert [t.get_text() for t in loss.get_legend().get_texts()] == ["ct200/a", "gpu1/b"]

    out = tmp_path / "curves.png"
    done = CliRunner().invoke(main, ["--logs-dir", str(logs), "plot", "a", "b", "-o", str(out)])
    assert done.exit_code == 0, done.output
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and str(out) in done.output
    missing = CliRunner().invoke(main, ["--logs-dir", str(logs), "plot", "a", "never-watched", "--host", "ct200"])
    assert missing.exit_code == 2 and "no events of run never-watched on ct200" in missing.output
    assert "dflash watch never-watched --host ct200" in missing.output


def test_status_line_of_a_regenerate_job_counts_prompts():
    from dflash_cli.status_line import RunProgress

    progress = RunProgress(lambda gpus: "")
    assert progress.render().plain == "no step yet"
    progress.update([{"type": "progress", "answered": 48, "total": 512, "eta_s": 133.2}])
    assert progress.render().plain == "answered 48/512 prompts  ETA 00:02:13"


def test_status_line_of_a_starting_run_names_its_start_up_phase():
    from dflash_cli.status_line import RunProgress

    progress = RunProgress(lambda gpus: "")
    progress.update([{"type": "startup", "phase": "load target", "state": "started", "label": "load target"}])
    assert progress.render().plain == "start-up: load target …"
    progress.update([{"type": "startup", "phase": "load target", "state": "done", "label": "load target"},
                     {"type": "startup", "phase": "build train step", "state": "started", "drafter": 1,
                      "cache": "warm", "label": "build train step drafter 1 (warm)"}])
    assert progress.render().plain == "start-up: build train step drafter 1 (warm) …"
    progress.update([{"type": "startup", "phase": "build train step", "state": "done", "label": "x"}])
    assert progress.render().plain == "no step yet"
