"""`dflash pull` over the `pct` transport (SSH to the node, then pct exec), with a run of
the real trainer: the export and the newest checkpoint arrive verified by sha256, a
second pull sends nothing, a part left by an earlier pull is completed from its length,
a dropped connection resumes mid-file, a spoiled local copy is fetched again, a folder
replaced on the host during a pull is listed again, and a run without export is refused."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from dflash_cli.commands import pull
from dflash_cli.local_state import RunLogs, RunRef
from dflash_cli.session import Session
from dflash_run import dflash
from support import kill_ssh_sessions, workspace_on_node, write_inventory
from support.disk import tmpfs
from support.train_configs import small_config

# On one xdist worker: the module's trained run is made once, not once per worker.
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("pull-trained-run")]

REPO = Path(__file__).resolve().parents[1]
HOST = "ct200"
#: a file added to the host's export after training, big enough that a transfer takes a
#: while and not named in SHA256SUMS, so the host hashes it itself
EXTRA = "extra.bin"
EXTRA_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class Trained:
    hosts: Path
    run_id: str  # succeeded: export/ and checkpoints/
    failed_id: str  # failed at startup: neither
    run_dir: Path  # the run's folder on the host, as the node sees it

    def dflash(self, logs: Path, *args: str) -> subprocess.CompletedProcess[str]:
        return dflash("--logs-dir", str(logs), *args, hosts=self.hosts)

    def pull(self, logs: Path, *options: str) -> subprocess.CompletedProcess[str]:
        """`dflash pull` of this run into `logs`, which must succeed."""
        done = self.dflash(logs, "pull", self.run_id, "--host", HOST, *options)
        assert done.returncode == 0, done.stderr
        return done

    def local_export(self, logs: Path) -> Path:
        """Where `dflash pull` puts this run's export under `logs`."""
        return logs / HOST / self.run_id / "export"

    def host_files(self, folder: str) -> dict[str, str]:
        """{path: sha256} of every file of the host's `folder` (export, or the checkpoint
        `latest` names)."""
        root = (self.run_dir / folder).resolve()
        return {p.relative_to(root).as_posix(): sha256(p) for p in root.rglob("*") if p.is_file()}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def local_files(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): sha256(p) for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, ssh_node, fake_pve) -> Trained:
    tmp = tmp_path_factory.mktemp("pull")
    hosts = write_inventory(tmp, ssh_node, fake_pve)
    logs = tmp / "launch logs"
    config = small_config(tmp / "small.yaml", checkpoint={"every": 5, "keep": 2})
    failing = small_config(tmp / "failing.yaml", faults=[{"thread": "drafter-0", "at": "startup", "kind": "raise"}])
    ids = []
    for path, extra in ((config, ()), (failing, ("--force",))):
        done = dflash("--logs-dir", str(logs), "launch", HOST, "--config", str(path), *extra, hosts=hosts)
        assert done.returncode == 0, done.stderr
        ids.append(done.stdout.strip())
    for run_id, outcome in zip(ids, (0, 1)):
        watched = dflash("--logs-dir", str(logs), "watch", run_id, "--host", HOST, hosts=hosts)
        assert watched.returncode == outcome, watched.stderr[-3000:]
    run_dir = workspace_on_node(fake_pve, tmp) / "runs" / ids[0]
    (run_dir / "export" / EXTRA).write_bytes(os.urandom(EXTRA_BYTES))
    return Trained(hosts, ids[0], ids[1], run_dir)


@pytest.mark.slow(seconds=21,
                  why="pulls from the module's trainer run over pct (made once, by the first test to run: ~55 s)")
def test_the_trainer_lists_every_file_of_its_export_and_checkpoints_in_sha256sums(trained):
    for folder in ("export", "checkpoints/latest"):
        root = (trained.run_dir / folder).resolve()
        listed = dict(reversed(line.split("  ", 1)) for line in (root / "SHA256SUMS").read_text().splitlines())
        on_disk = {name: digest for name, digest in trained.host_files(folder).items()
                   if name not in ("SHA256SUMS", EXTRA)}
        assert listed == on_disk and "model.safetensors" in listed, folder


@pytest.mark.slow(seconds=6,
                  why="pulls from the module's trainer run over pct (made once, by the first test to run: ~55 s)")
def test_pull_brings_the_export_verified_and_a_second_pull_sends_nothing(trained, tmp_path):
    logs = tmp_path / "logs"
    first = trained.pull(logs)
    export = trained.local_export(logs)
    assert first.stdout == f"{export}\n"
    host = trained.host_files("export")
    assert local_files(export) == host  # every file, byte for byte, and no part left over
    total = sum((trained.run_dir / "export" / name).stat().st_size for name in host)
    assert f"pulled {len(host)} files, {total} bytes, 0 skipped" in first.stderr

    again = trained.pull(logs)
    assert f"pulled 0 files, 0 bytes, {len(host)} skipped" in again.stderr
    assert local_files(export) == host


@pytest.mark.slow(seconds=9,
                  why="pulls from the module's trainer run over pct (made once, by the first test to run: ~55 s)")
def test_pull_checkpoint_brings_the_newest_checkpoint_too(trained, tmp_path):
    logs = tmp_path / "logs"
    done = trained.pull(logs, "--checkpoint")
    step = (trained.run_dir / "checkpoints" / "latest").resolve().name
    checkpoint = logs / HOST / trained.run_id / "checkpoint" / step
    assert done.stdout.splitlines() == [str(trained.local_export(logs)), str(checkpoint)]
    assert local_files(checkpoint) == trained.host_files("checkpoints/latest")
    assert {"model.safetensors", "optimizer.pt", "state.json", "SHA256SUMS"} <= set(local_files(checkpoint))
    assert step == f"step_{json.loads((checkpoint / 'state.json').read_text())['step']:06d}"


def in_process_pull(trained: Trained, logs: Path, **kwargs) -> tuple[pull.PullResult, dict[str, int]]:
    """pull.pull in this process, and what its connection carried: round trips and bytes."""
    session = Session(str(trained.hosts), logs)
    try:
        result = pull.pull(session, RunRef(HOST, trained.run_id), pull.PullOptions(**kwargs))
        transport = session.transport(session.host(HOST))
        return result, {"round_trips": transport.round_trips, "bytes_received": transport.bytes_received}
    finally:
        session.close()


@pytest.mark.slow(seconds=7,
                  why="pulls from the module's trainer run over pct (made once, by the first test to run: ~55 s)")
def test_a_part_left_by_an_earlier_pull_is_completed_from_its_length(trained, tmp_path):
    logs = tmp_path / "logs"
    full, _ = in_process_pull(trained, logs)
    export = trained.local_export(logs)
    data = (export / EXTRA).read_bytes()
    # As if the pull before had been cut off after 5 MiB of the file.
    (export / EXTRA).unlink()
    kept = 5 << 20
    part = pull.part_path(export / EXTRA, hashlib.sha256(data).hexdigest())
    part.write_bytes(data[:kept])

    resumed, carried = in_process_pull(trained, logs)
    assert (resumed.pulled, resumed.skipped) == (1, full.pulled - 1)
    assert resumed.bytes_received == EXTRA_BYTES - kept  # only the rest was sent
    # ...which the connection confirms: it carried the rest and a small listing, no more
    assert EXTRA_BYTES - kept <= carried["bytes_received"] < EXTRA_BYTES - kept + (64 << 10)
    assert (export / EXTRA).read_bytes() == data and not part.exists()


@pytest.mark.slow(seconds=6,
                  why="pulls from the module's trainer run over pct (made once, by the first test to run: ~55 s)")
def test_a_dropped_connection_mid_file_resumes_at_the_bytes_already_received(trained, ssh_node, tmp_path):
    logs = tmp_path / "logs"
    export = trained.local_export(logs)
    part = pull.part_path(export / EXTRA, trained.host_files("export")[EXTRA])
    dropped, finished = threading.Event(), threading.Event()

    def drop_mid_file() -> None:
        while not (dropped.is_set() or finished.is_set()):
            try:
                have = part.stat().st_size
            except FileNotFoundError:
                have = 0
            if 0 < have < EXTRA_BYTES // 2 and kill_ssh_sessions(ssh_node):
                dropped.set()
            time.sleep(0.001)

    killer = threading.Thread(target=drop_mid_file)
    killer.start()
    try:
        result, carried = in_process_pull(trained, logs)
    finally:
        finished.set()
        killer.join()
    assert dropped.is_set(), "the connection was never dropped mid-file"
    host = trained.host_files("export")
    assert local_files(export) == host
    sizes = sum((trained.run_dir / "export" / name).stat().st_size for name in host)
    assert result.bytes_received == sizes  # no byte was sent twice
    # one listing and one send-file per file, plus at least the one that resumed
    assert carried["round_trips"] >= 1 + len(host) + 1


@pytest.mark.slow(seconds=10,
                  why="pulls from the module's trainer run over pct (made once, by the first test to run: ~55 s)")
def test_a_spoiled_local_copy_is_fetched_again(trained, tmp_path):
    logs = tmp_path / "logs"
    trained.pull(logs)
    export = trained.local_export(logs)
    weights = export / "model.safetensors"
    spoiled = bytearray(weights.read_bytes())
    spoiled[len(spoiled) // 2] ^= 0xFF  # same size, one byte off
    weights.write_bytes(bytes(spoiled))

    again = trained.pull(logs)
    host = trained.host_files("export")
    assert f"pulled 1 files, {weights.stat().st_size} bytes, {len(host) - 1} skipped" in again.stderr
    assert local_files(export) == host


@pytest.mark.slow(seconds=8,
                  why="pulls from the module's trainer run over pct (made once, by the first test to run: ~55 s)")
def test_an_export_missing_a_file_its_sha256sums_lists_or_its_sha256sums_is_refused_once_pulled(trained, tmp_path):
    export = trained.run_dir / "export"
    for name, said in (("model.safetensors", "lacks model.safetensors, which its SHA256SUMS lists"),
                       ("SHA256SUMS", "has no SHA256SUMS: nothing says which files it must hold")):
        aside = trained.run_dir / f"{name}.aside"  # out of the export, restored for the module's other tests
        (export / name).rename(aside)
        try:
            done = trained.dflash(tmp_path / name, "pull", trained.run_id, "--host", HOST)
        finally:
            aside.rename(export / name)
        assert done.returncode == 2, done.stderr
        assert f"host {HOST}: export of run {trained.run_id} {said}" in done.stderr
        assert done.stdout == ""
    # Bytes that differ from the listed sha256 never take the file's name (received twice, then refused).
    weights = export / "model.safetensors"
    kept = weights.read_bytes()
    try:
        weights.write_bytes(kept[:100] + bytes(b ^ 0xFF for b in kept[100:116]) + kept[116:])
        spoiled = trained.dflash(tmp_path / "spoiled", "pull", trained.run_id, "--host", HOST)
    finally:
        weights.write_bytes(kept)
    assert spoiled.returncode == 2
    assert "model.safetensors does not match the sha256 listed for it" in spoiled.stderr
    assert not (trained.local_export(tmp_path / "spoiled") / "model.safetensors").exists()


@pytest.mark.slow(seconds=7,
                  why="pulls from the module's trainer run over pct (made once, by the first test to run: ~55 s)")
def test_a_file_replaced_on_the_host_after_the_listing_is_listed_again(trained, tmp_path):
    """The host refuses a file whose identity changed since the listing before sending a
    byte (a resumed offset would join two versions); the pull lists again and gets the
    new one."""
    logs = tmp_path / "logs"
    session = Session(str(trained.hosts), logs)
    try:
        puller = pull.Puller(session.agent(HOST), RunLogs(logs, RunRef(HOST, trained.run_id)), None, 30)
        [(folder, files)] = puller.list(checkpoint=False)
        (stale,) = [f for f in files if f.path == EXTRA]
        host_extra = trained.run_dir / "export" / EXTRA
        replacement = host_extra.with_name(".new")
        replacement.write_bytes(os.urandom(EXTRA_BYTES))
        os.replace(replacement, host_extra)  # as the trainer replaces its folders: a new inode
        local = pull.local_folder(puller.logs, folder) / EXTRA
        assert puller.fetch(local, stale) is False
        assert puller.bytes_received == 0 and not local.exists()
        result = puller.sync(checkpoint=False)
    finally:
        session.close()
    assert local_files(trained.local_export(logs)) == trained.host_files("export")
    assert result.pulled == len(trained.host_files("export"))


@pytest.mark.slow(seconds=1,
                  why="pulls from the module's trainer run over pct (made once, by the first test to run: ~55 s)")
def test_the_agent_refuses_a_stale_identity_or_a_path_out_of_the_folder_on_stderr(trained):
    workspace = trained.run_dir.parent.parent
    base = [sys.executable, str(REPO / "remote" / "agent.py"), "--workspace", str(workspace)]
    listing = json.loads(subprocess.run([*base, "artifacts", "--run-id", trained.run_id],
                                        capture_output=True, check=True).stdout)
    (export,) = listing["folders"]
    assert export["hashed_on_host"] == [EXTRA]  # the only file SHA256SUMS does not name
    config = next(f for f in export["files"] if f["path"] == "config.json")
    sent = subprocess.run([*base, "send-file", "--run-id", trained.run_id, "--folder", "export",
                           "--path", "config.json", "--offset", "5", f"--identity={config['identity']}"],
                          capture_output=True)
    assert sent.returncode == 0 and sent.stdout == (trained.run_dir / "export" / "config.json").read_bytes()[5:]
    for path, identity, kind in (("config.json", "0:0:0:0", "conflict"), ("../run.json", config["identity"], "usage")):
        refused = subprocess.run([*base, "send-file", "--run-id", trained.run_id, "--folder", "export",
                                  "--path", path, f"--identity={identity}"], capture_output=True)
        assert (refused.returncode, refused.stdout) == (2, b"")
        assert json.loads(refused.stderr)["kind"] == kind


@pytest.mark.slow(seconds=4,
                  why="pulls from the module's trainer run over pct (made once, by the first test to run: ~55 s)")
def test_a_run_without_export_is_refused_with_exit_2_naming_its_state(trained, tmp_path):
    logs = tmp_path / "logs"
    for extra in ((), ("--checkpoint",)):
        done = trained.dflash(logs, "pull", trained.failed_id, "--host", HOST, *extra)
        assert done.returncode == 2, done.stderr
        assert f"run {trained.failed_id!r} has no export yet (state FAILED)" in done.stderr
        assert done.stdout == "" and not (logs / HOST / trained.failed_id / "export").exists()


def test_a_host_whose_release_predates_pull_gets_a_hint_to_deploy(tmp_path):
    """The agent of a release older than `pull` knows no `artifacts` verb."""
    release = tmp_path / "ws" / "releases" / "old"
    release.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "9a6ba10", "remote/agent.py", "remote/dflash_agent"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(release)], input=archive, check=True)
    (tmp_path / "ws" / "current").symlink_to("releases/old")
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(json.dumps({"hosts": {"local": {"transport": "local", "workspace": str(tmp_path / "ws"),
                                                     "python": sys.executable}}}))
    (tmp_path / "logs" / "local" / "some-run").mkdir(parents=True)  # launched from here: no host is asked for it
    done = dflash("--logs-dir", str(tmp_path / "logs"), "pull", "some-run", "--host", "local", hosts=hosts)
    assert done.returncode == 2, done.stderr
    assert "hint: the host's current release predates pull: dflash deploy local" in done.stderr


# --- what a host lists decides nothing about local files it did not send ----------------------

def copy_of_the_run(trained: Trained, suffix: str) -> tuple[str, Path]:
    """A copy of the trained run beside it on the host (id, folder as the node sees it),
    for a test that spoils it: the module's other tests keep theirs."""
    run_id = f"{trained.run_id}-{suffix}"
    copy = trained.run_dir.parent / run_id
    shutil.copytree(trained.run_dir, copy, symlinks=True)
    return run_id, copy


def earlier_watch_files(local: Path) -> dict[str, str]:
    """What a watch keeps in a run's local folder, made up; {path: sha256} of the folder."""
    (local / "train.log").write_text("step 1\n")
    (local / "events.jsonl").write_text('{"type": "step", "step": 1}\n')
    (local / "events.out.tfevents.1.here").write_bytes(b"\0" * 64)
    return local_files(local)


@pytest.mark.slow(seconds=6,
                  why="pulls from the module's trainer run over pct (made once, by the first test to run: ~55 s)")
def test_a_checkpoints_latest_that_is_no_step_folder_is_refused_by_the_host(trained, tmp_path):
    """`latest -> ..` (or a step folder that is a link) would have the host list the run
    folder as the newest checkpoint."""
    run_id, copy = copy_of_the_run(trained, "latest-up")
    logs = tmp_path / "logs"
    try:
        first = trained.dflash(logs, "pull", run_id, "--host", HOST, "--checkpoint")
        assert first.returncode == 0, first.stderr
        before = earlier_watch_files(logs / HOST / run_id)
        latest = copy / "checkpoints" / "latest"
        step = os.readlink(latest)
        for target, problem in (("..", f"checkpoints/latest points to '..', which is not a checkpoint folder of the run"),
                                ("step_999999", "checkpoints/step_999999 is a link, not a folder of the run")):
            if target != "..":
                os.symlink("..", copy / "checkpoints" / target)
            latest.unlink()
            latest.symlink_to(target)
            done = trained.dflash(logs, "pull", run_id, "--host", HOST, "--checkpoint")
            assert done.returncode == 2, done.stderr
            assert f"dflash: error: host {HOST}: run {run_id!r}: {problem}" in " ".join(done.stderr.split())
            assert local_files(logs / HOST / run_id) == before  # nothing written, nothing removed
        latest.unlink()
        latest.symlink_to(step)
        again = trained.dflash(logs, "pull", run_id, "--host", HOST, "--checkpoint")
        assert again.returncode == 0 and "removed" not in again.stderr, again.stderr
    finally:
        shutil.rmtree(copy)


def hostile_tree(tmp_path: Path, old: str, new: str) -> Path:
    """This project's remote/ and configs/ with one change to the agent's artifacts.py: a
    source tree whose release answers as a compromised host would."""
    tree = tmp_path / "hostile tree"
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(REPO / "remote", tree / "remote", ignore=ignore)
    shutil.copytree(REPO / "configs", tree / "configs", ignore=ignore)
    artifacts = tree / "remote" / "dflash_agent" / "artifacts.py"
    text = artifacts.read_text()
    assert text.count(old) == 1, old
    artifacts.write_text(text.replace(old, new))
    return tree


@pytest.mark.slow(seconds=12, why="deploys a changed release to the ssh host and pulls the module's run from it")
def test_a_host_listing_a_folder_outside_the_checkpoints_removes_nothing_here(trained, ssh_node, fake_pve, tmp_path):
    """A compromised agent lists `checkpoints/..`, empty: the local folder it maps to is the
    run's own, whose files (the watch's mirror, an earlier export) a tidy-up would delete."""
    hosts = write_inventory(tmp_path, ssh_node, fake_pve)
    tree = hostile_tree(tmp_path, "folders.append(_listing(run, _latest_checkpoint(run, state), state))",
                        "folders.append(ArtifactFolder(folder='checkpoints/..', files=(), hashed_on_host=()))")
    logs = tmp_path / "logs"
    deployed = dflash("--logs-dir", str(logs), "deploy", "node", "--source", str(tree), hosts=hosts)
    assert deployed.returncode == 0, deployed.stderr
    shutil.copytree(trained.run_dir, tmp_path / "node ws" / "runs" / trained.run_id, symlinks=True)
    local = logs / "node" / trained.run_id
    (local / "export").mkdir(parents=True)
    (local / "export" / "from an earlier pull.json").write_text("{}")
    before = earlier_watch_files(local)

    done = dflash("--logs-dir", str(logs), "pull", trained.run_id, "--host", "node", "--checkpoint", hosts=hosts)
    assert done.returncode == 3, done.stderr
    assert ("dflash: error: host node: refusing the listed folder 'checkpoints/..': expected export or "
            "checkpoints/step_NNNNNN") in done.stderr
    assert local_files(local) == before and done.stdout == ""


@pytest.mark.slow(seconds=8,
                  why="pulls from the module's trainer run over pct (made once, by the first test to run: ~55 s)")
def test_the_tidy_up_removes_only_files_pull_brought(trained, tmp_path):
    """A file the host's folder no longer has is removed when a pull brought it, and
    never when it is the user's own (pulled.json lists what pull brought)."""
    run_id, copy = copy_of_the_run(trained, "tidy")
    logs = tmp_path / "logs"
    export = logs / HOST / run_id / "export"
    try:
        (copy / "export" / "dropped later.txt").write_text("an older export's\n")
        trained.dflash(logs, "pull", run_id, "--host", HOST)
        assert (export / "dropped later.txt").exists()
        assert "export/dropped later.txt" in json.loads((logs / HOST / run_id / "pulled.json").read_text())["files"]
        (copy / "export" / "dropped later.txt").unlink()
        (export / "my notes.txt").write_text("mine\n")
        (export / "mine").mkdir()
        (export / "mine" / "eval.json").write_text("{}")

        again = trained.dflash(logs, "pull", run_id, "--host", HOST)
        assert again.returncode == 0, again.stderr
        assert "1 removed (no longer on the host)" in again.stderr
        assert not (export / "dropped later.txt").exists()
        assert (export / "my notes.txt").read_text() == "mine\n" and (export / "mine" / "eval.json").exists()
        assert {name: digest for name, digest in local_files(export).items()
                if name not in ("my notes.txt", "mine/eval.json")} == local_files(copy / "export")
    finally:
        shutil.rmtree(copy)


@pytest.mark.slow(seconds=4,
                  why="pulls from the module's trainer run over pct (made once, by the first test to run: ~55 s)")
def test_a_listed_file_whose_local_path_leads_through_a_symlink_is_refused(trained, tmp_path):
    logs = tmp_path / "logs"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (logs / HOST / trained.run_id).mkdir(parents=True)
    (logs / HOST / trained.run_id / "export").symlink_to(elsewhere)
    done = trained.dflash(logs, "pull", trained.run_id, "--host", HOST)
    assert done.returncode == 3, done.stderr
    local = logs / HOST / trained.run_id
    assert re.search(re.escape(f"dflash: error: host {HOST}: refusing the path 'export/") + r"[^']+"
                     + re.escape(f"': {local}/export is a symlink, which could lead out of {local}"),
                     " ".join(done.stderr.split())), done.stderr
    assert list(elsewhere.iterdir()) == []


@pytest.mark.slow(seconds=6,
                  why="pulls from the module's trainer run over pct (made once, by the first test to run: ~55 s)")
def test_a_full_local_disk_ends_pull_with_its_own_exit_code_leaving_no_part(trained, tmp_path):
    with tmpfs(tmp_path / "logs", size_mib=8) as logs:  # the export holds a 16 MiB file
        done = trained.dflash(logs, "pull", trained.run_id, "--host", HOST)
        assert done.returncode == 5, done.stderr
        local = logs / HOST / trained.run_id
        assert re.search(re.escape(f"dflash: error: the local disk is full: cannot write {local}/export/")
                         + r"\S+\.[0-9a-f]{16}\.part \(\d+ bytes free on " + re.escape(f"{logs}); the run on its host "
                                                                                       "is not affected"),
                         " ".join(done.stderr.split())), done.stderr
        assert "Traceback" not in done.stderr and done.stdout == ""
        assert [p.name for p in logs.rglob("*") if p.name.endswith((".part", ".tmp"))] == []
        subprocess.run(["mount", "-o", "remount,size=64m", str(logs)], check=True)  # room made
        trained.pull(logs)
        assert local_files(local / "export") == trained.host_files("export")
