"""`watch` feeds the trackers of dflash.yaml (docs/cli.md "Trackers"): W&B offline files,
an MLflow file store and trackio's local storage, each read back with its own reader
(`wandb leet inspect --json`, MlflowClient, trackio's SQLiteStorage), no server, no
network. Every scalar TensorBoard gets reaches each once per step, in one tracker run
per run that a re-run watch, a dropped connection and a `dflash resume` go on with;
the config and the source commit are recorded; a tracker that fails mid-run is said and
left while the watch goes on; a missing package stops the watch before it follows. The
Python API's `dflash.watch` feeds them as the CLI's watch does."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml

import dflash_trainer as api  # the Python API (dflash_run's `dflash` runs the CLI)
from dflash_cli.errors import ExitCode
from dflash_cli.local_state import RunRef, set_latest
from dflash_run import dflash, dflash_in_process
from support import kill_ssh_sessions
from support.train_configs import small_config
from support.wait import wait_until
from support_agent import harness
from test_watch_events import events_script, step_event, tensorboard_scalars
from test_watch_log import Watch

pytestmark = pytest.mark.timeout(600)
agent = harness.agent  # the stand-in's fixture
# A watch that starts three trackers (imports, MLflow's store, W&B's service process) on a
# loaded machine: more than the 60 s a plain one is given to end.
FINISH_S = 180

TAGS = {"train/loss": "loss", "train/lr": "lr", "train/grad_norm": "grad_norm", "train/epoch": "epoch",
        "throughput/samples_per_s": "samples_per_s", "throughput/tokens_per_s": "tokens_per_s"}
SOURCE = {"kind": "git", "path": "/src/dflash", "release_id": "rel-0001", "dflash_version": "0.1.0",
          "git_commit": "0123456789abcdef0123456789abcdef01234567", "dirty": True, "diff_sha256": "ab" * 32,
          "modified": ["remote/dflash_train/x.py"], "modified_count": 1, "git_problem": None}


@pytest.fixture(scope="session")
def trackio_dir(tmp_path_factory) -> Path:
    """trackio fixes its folder when first imported: one per test process, set before."""
    path = tmp_path_factory.mktemp("trackio")
    os.environ["TRACKIO_DIR"] = str(path)
    return path


@pytest.fixture
def trackers(tmp_path, trackio_dir, monkeypatch) -> dict:
    """dflash.yaml with all three trackers, in this test's folders; nothing reaches a network."""
    settings = {"wandb": {"mode": "offline", "project": "dflash-test", "dir": str(tmp_path / "wandb-files")},
                "mlflow": {"tracking_uri": (tmp_path / "mlruns").as_uri(), "experiment": "dflash-test"},
                "trackio": {"project": f"t-{tmp_path.name}"}}
    path = tmp_path / "dflash.yaml"
    path.write_text(yaml.safe_dump({"trackers": settings}))
    monkeypatch.setenv("DFLASH_CLI_CONFIG", str(path))
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path / "wandb-default"),
                        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"), "WANDB_CACHE_DIR": str(tmp_path / "wc"),
                        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"), "MLFLOW_ALLOW_FILE_STORE": "true"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("TRACKIO_SPACE_ID", raising=False)
    return settings


# -- each tracker's own reader -----------------------------------------------------------
def wandb_files(settings: dict, run_id: str) -> list[list[dict]]:
    """The records of each offline folder of W&B run `run_id`, oldest first, as
    `wandb leet inspect --json` prints them."""
    runs = []
    for path in Path(settings["wandb"]["dir"]).glob(f"wandb/offline-run-*-{run_id}*/run-{run_id}.wandb"):
        done = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        runs.append([json.loads(line) for line in done.stdout.splitlines()])
    # A folder whose service died before it wrote the run's record holds nothing of it.
    runs = [records for records in runs if any(r["type"] == "run" for r in records)]
    return sorted(runs, key=lambda records: next(r["run"]["start_time"] for r in records if r["type"] == "run"))


def wandb_config(files: list[list[dict]]) -> dict:
    """The W&B run's config, as its run record and config updates leave it."""
    config: dict = {}
    for records in files:
        for record in records:
            if record["type"] in ("run", "config"):
                config.update((record["run"]["config"] if record["type"] == "run" else record["config"])["update"])
    return config


def wandb_rows(files: list[list[dict]]) -> tuple[list[dict], int]:
    """The W&B run's rows in the order of their numbers (W&B's `_step`), and how many were
    sent again: a watch that did not finish its W&B run sends its rows again, each with
    the number and the figures it had. A folder that rewinds the run (its run record's
    `branch_point`, W&B's `resume_from`) drops the rows after that number, as W&B does
    when it is synced."""
    rows: dict[int, dict] = {}
    resent = 0
    for records in files:
        run = next(r["run"] for r in records if r["type"] == "run")
        if "branch_point" in run:
            point = run["branch_point"]
            assert point["metric"] == "_step"
            # protobuf's JSON leaves out a field that holds its default: value 0
            rows = {number: row for number, row in rows.items() if number <= point.get("value", 0)}
        items = [r["history"]["item"] for r in records if r["type"] == "history"]
        numbers = [item["_step"] for item in items]
        assert numbers == sorted(set(numbers)), f"row numbers grow within a watch: {numbers}"
        for item in items:
            figures = {key: value for key, value in item.items() if not key.startswith("_")}
            if item["_step"] in rows:
                assert rows[item["_step"]] == figures, (item, rows[item["_step"]])
                resent += 1
            rows[item["_step"]] = figures
    return [rows[number] for number in sorted(rows)], resent


def mlflow_run(settings: dict):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=settings["mlflow"]["tracking_uri"])
    experiment = client.get_experiment_by_name(settings["mlflow"]["experiment"])
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return client, runs[0]


def trackio_rows(settings: dict, run_id: str) -> list[dict]:
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_logs(settings["trackio"]["project"], run_id)


def series_by_tracker(settings: dict, run_id: str, resent: int | None = 0,
                      trackers: tuple[str, ...] = ("wandb", "mlflow", "trackio")) -> dict[str, dict[str, list]]:
    """{tracker: {tag: [(step, value), ...]}} as each tracker's reader gives them;
    `resent`: how many W&B rows were sent again, each as it was (see wandb_rows); None: any."""
    series: dict[str, dict[str, list]] = {tracker: {} for tracker in trackers}
    if "wandb" in trackers:
        rows, sent_again = wandb_rows(wandb_files(settings, run_id))
        assert resent is None or sent_again == resent
        for row in rows:
            for tag, value in row.items():
                if tag != "train/global_step":
                    series["wandb"].setdefault(tag, []).append((row["train/global_step"], value))
    if "mlflow" in trackers:
        client, run = mlflow_run(settings)
        series["mlflow"] = {key.replace("_at_", "@"): [(m.step, m.value)
                                                       for m in client.get_metric_history(run.info.run_id, key)]
                            for key in run.data.metrics}
    if "trackio" in trackers:
        for row in trackio_rows(settings, run_id):
            for tag, value in row.items():
                if tag not in ("step", "timestamp"):
                    series["trackio"].setdefault(tag, []).append((row["step"], value))
    return series


def wait_sent(watch: Watch, mirror: Path, step: int) -> None:
    """Until the trackers were sent the steps up to `step`: trackers.json says MLflow and
    trackio hold them (W&B's record moves when its run finishes; it was sent them with them)."""
    try:
        wait_until(lambda: {k: v for k, v in sent(mirror).items() if k != "wandb"} == {"mlflow": step, "trackio": step},
                   FINISH_S,
                   f"steps up to {step} sent", give_up=lambda: watch.proc.poll() is not None and
                   f"watch exited {watch.proc.returncode}" or None)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; sent: {sent(mirror)}; the watch's stderr:\n{watch.stderr.decode()}") from None


def sent(mirror: Path) -> dict[str, int]:
    """The last step each tracker was sent, from trackers.json."""
    try:
        records = json.loads((mirror / "trackers.json").read_text())
    except (OSError, ValueError):
        return {}
    return {r["tracker"]: r["steps"].get("step", 0) for r in records}


def assert_every_scalar_once(series: dict, events: list[dict]) -> None:
    """Each tracker holds each tag of these step and eval events once per step, with the value sent."""
    steps = [e for e in events if e["type"] == "step"]
    evals = [e for e in events if e["type"] == "eval"]
    for tracker, tags in series.items():
        for tag, field in TAGS.items():
            assert sorted(tags[tag]) == [(e["step"], pytest.approx(e[field])) for e in steps], (tracker, tag)
        assert sorted(tags["train/acc@1"]) == [(e["step"], pytest.approx(e["acc"][0])) for e in steps], tracker
        for position in (1, 2, 3):
            assert sorted(tags[f"train/acc_by_position/{position}"]) == [
                (e["step"], pytest.approx(e["acc"][position - 1])) for e in steps], (tracker, position)
        assert sorted(tags.get("eval/acceptance_length", [])) == [
            (e["step"], pytest.approx(e["acceptance_length"])) for e in evals], tracker


# -- a scripted run: re-run watch, dropped connection, a tracker's record behind ----------------
@pytest.fixture
def hosts(agent, make_inventory, tmp_path):
    workspace = {"workspace": str(agent.workspace)}
    return make_inventory(tmp_path, local=workspace, node=workspace)


@pytest.mark.slow(seconds=30, why="three watches, each starting three trackers, and W&B's reader run on each of "
                                  "their files")
def test_trackers_get_every_scalar_once_across_a_rerun_watch_a_drop_and_a_lost_record(
        agent, hosts, ssh_node, trackers, tmp_path):
    late_eval = {"type": "eval", "step": 2, "acceptance_length": 1.75, "mean_per_prompt": 1.5}
    trained_again = dict(step_event(4), loss=99.0)  # a step a resume trains again: its first values stay
    agent.launch("tr", [*events_script(1, 2), {"wait_file": "go1"}, *events_script(3, 3),
                        {"event": late_eval},  # measured in the background: it arrives after step 3
                        *events_script(4, 4), {"wait_file": "go2"}, {"event": trained_again},
                        *events_script(5, 6)],
                 "--source-json", json.dumps(SOURCE))
    logs = tmp_path / "logs"
    mirror = logs / "node" / "tr"
    first = Watch(hosts, logs, "tr", "--host", "node")
    wait_sent(first, mirror, 2)
    first.proc.send_signal(signal.SIGINT)
    assert first.finish(FINISH_S) == 130, first.stderr.decode()
    assert sent(mirror) == {"wandb": 2, "mlflow": 2, "trackio": 2}  # W&B's run finished at the detach
    stderr = first.stderr.decode()
    assert "tracker wandb: W&B offline run tr in " in stderr and "tracker mlflow: MLflow run " in stderr
    assert "tracker trackio: trackio run tr of project" in stderr
    assert b"Trackio" not in first.stdout  # trackio's notices are not the run's log

    agent.touch("tr", "go1")
    again = Watch(hosts, logs, "tr", "--host", "node", "--retry-for", "60")
    wait_sent(again, mirror, 4)
    assert kill_ssh_sessions(ssh_node)
    agent.touch("tr", "go2")
    assert again.finish(FINISH_S) == 0, again.stderr.decode()
    assert "reconnecting" in again.stderr.decode() and "failed" not in again.stderr.decode()

    # MLflow and trackio say what they hold: a record behind theirs (a watch killed after
    # sending, before saving it) sends nothing twice.
    records = json.loads((mirror / "trackers.json").read_text())
    for record in records:
        if record["tracker"] != "wandb":
            record.update(offset=0, steps={})
    (mirror / "trackers.json").write_text(json.dumps(records))
    last = Watch(hosts, logs, "tr", "--host", "node")
    assert last.finish(FINISH_S) == 0, last.stderr.decode()

    events = [*(step_event(s) for s in range(1, 7)), late_eval]
    series = series_by_tracker(trackers, "tr")
    assert_every_scalar_once(series, events)
    for tracker in series.values():
        assert tracker["memory/peak_gib/drafter-0"] == [(s, pytest.approx(s)) for s in range(1, 7)]
        assert "memory/peak_gib/drafter-1" not in tracker  # null: a CPU drafter has no counter

    # One tracker run, resumed: W&B's id is the run id, one offline folder per watch.
    files = wandb_files(trackers, "tr")
    assert len(files) == 3
    runs = [next(r["run"] for r in records if r["type"] == "run") for records in files]
    assert {run["run_id"] for run in runs} == {"tr"} and all(run["resume"] for run in runs)
    assert runs[0]["git"]["commit"] == SOURCE["git_commit"]
    config = wandb_config(files)["dflash"]
    assert config["source"]["diff_sha256"] == SOURCE["diff_sha256"] and config["release_id"] == "rel-0001"
    client, run = mlflow_run(trackers)
    assert run.info.status == "FINISHED"
    assert run.data.tags["mlflow.source.git.commit"] == SOURCE["git_commit"]
    assert run.data.tags["dflash.source.diff_sha256"] == SOURCE["diff_sha256"]
    assert run.data.tags["dflash.run_id"] == "tr" and run.data.tags["mlflow.runName"] == "tr"


# -- a resume that trains steps again -------------------------------------------------------------
@pytest.mark.slow(seconds=30, why="two watches, each starting three trackers, the rebuilds, and W&B's reader")
def test_the_attempt_that_continued_the_run_is_what_every_sink_holds(agent, hosts, trackers, tmp_path):
    """Attempt 0 runs to step 6 and fails; attempt 1 resumes from the checkpoint of step 4,
    evaluates there and trains steps 5-8 again, with other values (CPU training is
    deterministic; a GPU's is not): TensorBoard, W&B, MLflow, trackio and `dflash plot`
    each hold one value per tag and step, attempt 1's from step 4's eval on."""
    def again(step: int) -> dict:
        return dict(step_event(step), loss=50.0 + step, lr=0.5, tokens_per_s=7.0 * step)

    def evaluation(step: int, value: float) -> dict:
        return {"type": "eval", "step": step, "acceptance_length": value, "mean_per_prompt": value}

    first = [*events_script(1, 2), {"event": evaluation(2, 1.2)}, *events_script(3, 4), {"event": evaluation(4, 1.4)},
             *events_script(5, 6), {"event": evaluation(6, 1.6)}]
    resumed = {"type": "attempt", "attempt": 1, "reason": "resume", "resume_step": 4, "release_id": "rel-0001"}
    second = [{"event": evaluation(4, 2.4)}, *({"event": again(step)} for step in range(5, 9)),
              {"event": evaluation(6, 2.6)}]
    agent.launch("rs", [*first, {"wait_file": "go"}, {"event": resumed}, *second], "--source-json", json.dumps(SOURCE))
    logs = tmp_path / "logs"
    mirror = logs / "node" / "rs"
    watch = Watch(hosts, logs, "rs", "--host", "node")
    wait_sent(watch, mirror, 6)  # attempt 0's values, in every tracker
    watch.proc.send_signal(signal.SIGINT)
    assert watch.finish(FINISH_S) == 130, watch.stderr.decode()
    agent.touch("rs", "go")
    last = Watch(hosts, logs, "rs", "--host", "node")
    assert last.finish(FINISH_S) == 0, last.stderr.decode()

    kept = [*(step_event(step) for step in range(1, 5)), evaluation(2, 1.2), evaluation(4, 2.4),
            *(again(step) for step in range(5, 9)), evaluation(6, 2.6)]
    series = series_by_tracker(trackers, "rs", resent=None)
    series["tensorboard"] = tensorboard_scalars(mirror)
    assert_every_scalar_once(series, kept)
    mlflow_run(trackers)  # one MLflow run: the one it replaced was deleted

    from dflash_cli.commands import plot
    from dflash_cli.local_state import RunRef as Ref

    (drawn,) = plot.load(logs, [Ref("node", "rs")]).values()
    for title, kind, field in plot.PANELS:
        steps, values = plot.series(drawn, kind, field)
        expected = sorted((e["step"], e[field]) for e in kept if e["type"] == kind.name)
        assert list(zip(steps, values)) == expected, title


# -- a real run, stopped and resumed -----------------------------------------------------------
@pytest.mark.slow(seconds=45, why="the real trainer: a stopped attempt and its resume, each followed with "
                                  "three trackers")
def test_a_real_run_and_its_resume_fill_one_tracker_run_with_its_config_and_commit(
        make_inventory, trackers, tmp_path):
    inventory = make_inventory(tmp_path)
    workspace = Path(yaml.safe_load(inventory.read_text())["hosts"]["local"]["workspace"])
    logs = tmp_path / "logs"
    hang = [{"thread": "prefetch", "at": "step:4", "kind": "hang", "attempt": 0}]
    config = small_config(tmp_path / "tracked.yaml", faults=hang)
    out, err = tmp_path / "launch.out", tmp_path / "launch.err"
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        launched = subprocess.Popen([sys.executable, "-m", "dflash_cli", "--hosts", str(inventory), "--logs-dir",
                                     str(logs), "launch", "local", "--config", str(config), "--follow"],
                                    stdout=stdout, stderr=stderr, env={**os.environ, "NO_COLOR": "1"})
    try:
        def three_steps_held() -> bool:
            return any({k: v for k, v in sent(p).items() if k != "wandb"} == {"mlflow": 3, "trackio": 3}
                       for p in logs.glob("local/*"))

        wait_until(three_steps_held, 480, "steps 1-3 held by MLflow and trackio",
                   give_up=lambda: launched.poll() is not None and f"launch --follow exited: {err.read_text()}" or None)
        (mirror,) = logs.glob("local/*")
        run_id = mirror.name
        stopped = dflash_in_process("--hosts", str(inventory), "--logs-dir", str(logs), "stop", run_id,
                                    "--host", "local")
        assert stopped.returncode == 0, stopped.stderr
        launched.wait(timeout=FINISH_S)
    finally:
        if launched.poll() is None:
            launched.kill()
            launched.wait()
    assert launched.returncode == 4, err.read_text()[-3000:]
    assert sent(mirror) == {"wandb": 3, "mlflow": 3, "trackio": 3}
    resumed = dflash("--logs-dir", str(logs), "resume", run_id, "--host", "local", "--follow", hosts=inventory,
                     timeout=480)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    run_dir = workspace / "runs" / run_id
    host_events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    steps = [e for e in host_events if e["type"] == "step"]
    assert [e["step"] for e in steps] == list(range(1, 7))
    evals, last = [], -1
    for event in host_events:  # the baseline, the resumed attempt's baseline at step 3, the final one
        if event["type"] == "eval" and event["step"] > last:
            evals.append(event)
            last = event["step"]
    assert [e["step"] for e in evals] == [0, 3, 6]
    assert_every_scalar_once(series_by_tracker(trackers, run_id), steps + evals)

    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    source = json.loads((run_dir / "run.json").read_text())["source"]
    assert source["git_commit"]  # launched from this checkout
    files = wandb_files(trackers, run_id)
    assert len(files) == 2  # launch --follow's watch, resume --follow's
    for records in files:
        run = next(r["run"] for r in records if r["type"] == "run")
        assert run["git"]["commit"] == source["git_commit"]
    updates = wandb_config(files)
    assert {k: v for k, v in updates.items() if k not in ("_wandb", "dflash")} == resolved
    assert updates["dflash"]["source"]["git_commit"] == source["git_commit"]
    assert updates["dflash"]["source"]["diff_sha256"] == source["diff_sha256"]
    assert updates["dflash"]["attempt"] == 1

    client, run = mlflow_run(trackers)
    assert run.info.status == "FINISHED" and run.data.tags["dflash.run_id"] == run_id
    assert run.data.tags["mlflow.source.git.commit"] == source["git_commit"]
    params = run.data.params
    assert params["optim.lr"] == json.dumps(resolved["optim"]["lr"])
    assert params["devices.drafters"] == '["cpu", "cpu"]' and params["target.tiny.hidden_size"] == "64"
    assert len(params) == len(list(_leaves(resolved)))

    from trackio.sqlite_storage import SQLiteStorage

    recorded = SQLiteStorage.get_run_config(trackers["trackio"]["project"], run_id)
    assert {k: v for k, v in recorded.items() if not k.startswith("_") and k != "dflash"} == resolved
    assert recorded["dflash"]["source"]["git_commit"] == source["git_commit"]


def _leaves(data, prefix=""):
    if isinstance(data, dict) and data:
        for key, value in data.items():
            yield from _leaves(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1]


# -- a tracker that fails mid-run -----------------------------------------------------------------
def children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


@pytest.mark.slow(seconds=17, why="two watches, each starting three trackers, and W&B's reader")
def test_a_tracker_that_fails_mid_run_is_said_once_and_the_watch_follows_on(agent, hosts, trackers,
                                                                           tmp_path):
    agent.launch("fl", [*events_script(1, 2), {"wait_file": "go"}, *events_script(3, 6)])
    logs = tmp_path / "logs"
    mirror = logs / "local" / "fl"
    watch = Watch(hosts, logs, "fl", "--host", "local")
    wait_sent(watch, mirror, 2)
    # W&B's service process, which its runs send through: gone, every call raises.
    services = [pid for pid in children(watch.proc.pid) if b"wandb-core" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert services, children(watch.proc.pid)
    for pid in services:
        os.kill(pid, signal.SIGKILL)
    agent.touch("fl", "go")
    assert watch.finish(FINISH_S) == 0, watch.stderr.decode()
    stderr = watch.stderr.decode()
    assert stderr.count("warning: tracker wandb failed (") == 1, stderr
    assert "Traceback" not in stderr  # W&B's exit hook has nothing left to print
    assert "this watch goes on without it" in stderr
    assert stderr.rindex("tracker wandb failed during this watch") > stderr.index("ended: SUCCEEDED")
    assert "(ConnectionResetError: Connection lost): the next `dflash watch fl` sends it every step" in stderr
    assert watch.stdout == (agent.run_dir("fl") / "train.log").read_bytes()  # followed to the end
    assert sent(mirror) == {"wandb": 0, "mlflow": 6, "trackio": 6}  # W&B's run did not finish: it holds none

    later = Watch(hosts, logs, "fl", "--host", "local")
    assert later.finish(FINISH_S) == 0, later.stderr.decode()
    assert "failed" not in later.stderr.decode()
    assert sent(mirror) == {"wandb": 6, "mlflow": 6, "trackio": 6}
    # The rows the dead service had written before (if any) come again, as they were.
    assert_every_scalar_once(series_by_tracker(trackers, "fl", resent=None), [step_event(s) for s in range(1, 7)])


def test_a_run_on_two_hosts_has_one_tracker_run_fed_by_rank_0(agent, hosts, trackers, tmp_path):
    # Both hosts' parts are the stand-in's one run: rank 0's events alone reach the trackers.
    agent.launch("mh", events_script(1, 3))
    logs = tmp_path / "logs"
    set_latest(logs, RunRef("local", "mh", ("local", "node")))
    watch = Watch(hosts, logs, "mh")
    assert watch.finish(FINISH_S) == 0, watch.stderr.decode()
    stderr = watch.stderr.decode()
    assert "local| tracker wandb: W&B offline run mh" in stderr and "node| tracker" not in stderr
    # trackio's notices are dropped, every host's log is there whole.
    assert b"Trackio" not in watch.stdout
    log = (agent.run_dir("mh") / "train.log").read_bytes()
    for host in ("local", "node"):
        label = f"{host}| ".encode()
        shown = b"".join(line[len(label):] for line in watch.stdout.splitlines(keepends=True) if line.startswith(label))
        assert shown == log, (host, watch.stdout)
    assert sent(logs / "local" / "mh") == {"wandb": 3, "mlflow": 3, "trackio": 3}
    assert not (logs / "node" / "mh" / "trackers.json").exists()
    assert_every_scalar_once(series_by_tracker(trackers, "mh"), [step_event(s) for s in (1, 2, 3)])
    assert wandb_config(wandb_files(trackers, "mh"))["dflash"]["hosts"] == ["local", "node"]


def test_mlflow_takes_a_sqlite_store_too(agent, hosts, tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    path = tmp_path / "dflash.yaml"
    path.write_text(yaml.safe_dump({"trackers": {"mlflow": {"tracking_uri": uri, "run_name": "{name} on {host}"}}}))
    monkeypatch.setenv("DFLASH_CLI_CONFIG", str(path))
    agent.launch("sq", events_script(1, 3), "--name", "tiny")
    watch = Watch(hosts, tmp_path / "logs", "sq", "--host", "local")
    assert watch.finish(FINISH_S) == 0, watch.stderr.decode()
    series = series_by_tracker({"mlflow": {"tracking_uri": uri, "experiment": "dflash"}}, "sq", trackers=("mlflow",))
    assert series["mlflow"]["train/loss"] == [(s, pytest.approx(step_event(s)["loss"])) for s in (1, 2, 3)]
    client, run = mlflow_run({"mlflow": {"tracking_uri": uri, "experiment": "dflash"}})
    assert run.info.run_name == "tiny on local" and run.data.tags["dflash.run_id"] == "sq"


def test_trackio_notices_are_dropped_in_its_thread_only(capfd):
    """Rank 0's part of a run on several hosts starts its trackers in a thread of its own
    while the other hosts' lines are printed: those reach stdout, text and bytes."""
    from dflash_cli.trackers.trackio_sink import quiet_this_thread

    entered, printed = threading.Event(), threading.Event()

    def print_log() -> None:
        entered.wait(10)
        sys.stdout.write("node| text\n")
        sys.stdout.flush()
        sys.stdout.buffer.write(b"node| bytes\n")  # as console.remote_text writes the log
        sys.stdout.buffer.flush()
        printed.set()

    thread = threading.Thread(target=print_log)
    thread.start()
    with quiet_this_thread():
        print("* Trackio project initialized: dflash")
        entered.set()
        assert printed.wait(10)
    thread.join()
    print("after")
    assert capfd.readouterr().out == "node| text\nnode| bytes\nafter\n"


# -- the Python API's watch ---------------------------------------------------------------------
@pytest.fixture
def wandb_teardown():
    """W&B's service started in this process is stopped, and WANDB_SERVICE, which it sets
    for the subprocesses to join it, cleared: each later watch starts its own."""
    def teardown() -> None:
        if "wandb" in sys.modules:
            sys.modules["wandb"].teardown()
            assert "WANDB_SERVICE" not in os.environ

    yield teardown
    teardown()


@pytest.mark.slow(seconds=20, why="an in-process watch and a CLI one, each starting three trackers, and W&B's "
                                  "reader")
def test_the_python_api_feeds_the_tracker_run_a_cli_watch_goes_on_with(agent, hosts, trackers, tmp_path, capfd,
                                                                       wandb_teardown):
    agent.launch("ap", [*events_script(1, 2), {"wait_file": "go"}, *events_script(3, 4)])
    logs = tmp_path / "logs"
    mirror = logs / "local" / "ap"
    items = api.watch("ap", host="local", hosts_file=hosts, logs_dir=logs)  # dflash.yaml: DFLASH_CLI_CONFIG
    for item in items:
        if isinstance(item, api.Events) and any(event.get("step") == 2 for event in item.events):
            break
    items.close()  # detaches, and ends this watch's part of each tracker run
    assert sent(mirror) == {"wandb": 2, "mlflow": 2, "trackio": 2}
    out, err = capfd.readouterr()
    assert out == "", out  # the API prints nothing on stdout: trackio's notices neither
    assert "tracker mlflow: MLflow run " in err
    wandb_teardown()

    agent.touch("ap", "go")
    later = Watch(hosts, logs, "ap", "--host", "local")
    assert later.finish(FINISH_S) == 0, later.stderr.decode()
    assert sent(mirror) == {"wandb": 4, "mlflow": 4, "trackio": 4}
    assert_every_scalar_once(series_by_tracker(trackers, "ap"), [step_event(s) for s in range(1, 5)])
    assert len(wandb_files(trackers, "ap")) == 2  # one W&B run, a folder per watch


def test_the_python_api_checks_the_packages_when_called_and_takes_no_trackers_or_another_file(
        agent, hosts, trackers, tmp_path, monkeypatch):
    agent.launch("ak", events_script(1, 3))
    logs = tmp_path / "logs"
    mirror = logs / "local" / "ak"
    monkeypatch.setitem(sys.modules, "trackio", None)  # `import trackio` raises ModuleNotFoundError, as without it
    with pytest.raises(api.DflashError) as raised:
        api.watch("ak", host="local", hosts_file=hosts, logs_dir=logs)
    assert raised.value.exit_code == ExitCode.USAGE
    assert "dflash.yaml: trackers.trackio: the Python package trackio is not installed here: " \
           "pip install 'dflash-trainer[trackio]'" in raised.value.message
    assert not mirror.exists()  # nothing was followed

    items = list(api.watch("ak", host="local", hosts_file=hosts, logs_dir=logs, trackers=False))
    assert items[-1].exit_code == ExitCode.OK and not (mirror / "trackers.json").exists()

    # Another file, naming MLflow alone: the next watch gives it what the last one brought home.
    only_mlflow = tmp_path / "mlflow-only.yaml"
    only_mlflow.write_text(yaml.safe_dump({"trackers": {"mlflow": trackers["mlflow"]}}))
    items = list(api.watch("ak", host="local", hosts_file=hosts, logs_dir=logs, cli_config_file=only_mlflow))
    assert items[-1].exit_code == ExitCode.OK
    assert sent(mirror) == {"mlflow": 3}
    series = series_by_tracker(trackers, "ak", trackers=("mlflow",))
    assert series["mlflow"]["train/loss"] == [(s, pytest.approx(step_event(s)["loss"])) for s in (1, 2, 3)]


# -- configuration and packages -------------------------------------------------------------------
@pytest.mark.parametrize("tracker,pip", [("wandb", "wandb"), ("mlflow", "mlflow-skinny"), ("trackio", "trackio")])
def test_a_tracker_whose_package_is_missing_stops_the_watch_before_it_follows(
        agent, hosts, trackers, tmp_path, monkeypatch, tracker, pip):
    agent.launch("np", events_script(1, 2))
    monkeypatch.setitem(sys.modules, tracker, None)  # `import NAME` raises ModuleNotFoundError, as without it
    logs = tmp_path / "logs"
    done = dflash_in_process("--logs-dir", str(logs), "watch", "np", "--host", "local", hosts=hosts)
    assert done.returncode == 2, done.stderr
    assert f"dflash.yaml: trackers.{tracker}: the Python package {pip} is not installed here: " \
           f"pip install 'dflash-trainer[{tracker}]'" in done.stderr
    assert "hint: or follow without trackers: dflash watch --no-trackers" in done.stderr
    assert not (logs / "local" / "np").exists()  # nothing was followed

    config = small_config(tmp_path / "never.yaml")
    launched = dflash_in_process("--logs-dir", str(logs), "launch", "local", "--config", str(config), "--follow",
                                 hosts=hosts)
    assert launched.returncode == 2 and f"trackers.{tracker}: the Python package {pip}" in launched.stderr
    assert not list((agent.workspace / "runs").glob("never-*")) and not list(logs.glob("local/never-*"))

    plain = dflash_in_process("--logs-dir", str(logs), "watch", "np", "--host", "local", "--no-trackers",
                              hosts=hosts)
    assert plain.returncode == 0, plain.stderr
    assert not (logs / "local" / "np" / "trackers.json").exists()


def test_a_bad_dflash_yaml_is_refused_naming_the_file_and_the_key(tmp_path, monkeypatch):
    path = tmp_path / "dflash.yaml"
    monkeypatch.setenv("DFLASH_CLI_CONFIG", str(path))
    (tmp_path / "logs" / "local" / "some-run").mkdir(parents=True)  # launched from here: no host is asked for it
    cases = {"trackers: {wandb: {mode: offline, projet: x}}": "trackers.wandb.projet: unknown key",
             "trackers: {mlflow: {}}": "trackers.mlflow.tracking_uri: missing required key",
             "trackers: {wandb: {mode: sometimes}}": "trackers.wandb.mode: expected one of 'online' | 'offline'",
             "trackers: {comet: {}}": "trackers.comet: unknown key (known keys: mlflow, trackio, wandb)",
             "trackers: {wandb: {run_name: '{run}'}}":
                 "trackers.wandb: 'run_name' '{run}': unknown placeholder {run} (known: {run_id}, {name}, {host})"}
    for text, message in cases.items():
        path.write_text(text)
        done = dflash_in_process("watch", "some-run", "--host", "local")
        assert done.returncode == 2, (text, done.stderr)
        assert f"{path}: {message}" in done.stderr, (text, done.stderr)
    missing = dflash_in_process("--cli-config", str(tmp_path / "absent.yaml"), "watch", "some-run", "--host", "local")
    assert missing.returncode == 2 and f"{tmp_path / 'absent.yaml'}: CLI config file not found" in missing.stderr
