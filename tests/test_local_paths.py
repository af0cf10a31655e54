"""Names that become paths under logs/ (docs/cli.md "Local state"): a run id or host that is
not one folder name, from the command line or logs/latest.json, is refused before anything
is written; a release id or file hash a host sent never names a file outside
logs/releases/; and a listing `pull` gets (crafted here as a compromised host could send
it) names no place outside the run's folder. `pull` against a real hostile host is
tests/test_pull.py's."""
from __future__ import annotations

import hashlib
import json

import pytest

from dflash_cli.commands import pull
from dflash_cli.errors import DflashError, ExitCode
from dflash_cli.local_state import RunLogs, RunRef
from dflash_cli.release_store import ReleaseStore
from dflash_cli.session import Session
from dflash_contract.replies import ArtifactFile, ArtifactFolder, ArtifactsReply
from dflash_contract.states import RunState
from dflash_run import dflash_in_process


def test_watch_of_a_path_for_a_run_id_writes_nothing_there(make_inventory, tmp_path):
    hosts = make_inventory(tmp_path)
    outside = tmp_path / "not logs" / "x"
    done = dflash_in_process("--logs-dir", str(tmp_path / "logs"), "watch", str(outside), "--host", "local",
                             hosts=hosts)
    assert done.returncode == 2, done.stderr
    assert (f"dflash: error: run {str(outside)!r} on host 'local': its run id cannot name a folder under "
            f"{tmp_path / 'logs'}") in " ".join(done.stderr.split())
    assert not (tmp_path / "not logs").exists() and not (tmp_path / "logs").exists()


@pytest.mark.parametrize("recorded", [{"host": "local", "run_id": "../../escaped", "hosts": []},
                                      {"host": "..", "run_id": "escaped", "hosts": []}])
def test_a_latest_run_that_names_no_folder_is_refused_naming_the_file(make_inventory, tmp_path, recorded):
    hosts = make_inventory(tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "latest.json").write_text(json.dumps(recorded))
    done = dflash_in_process("--logs-dir", str(logs), "watch", hosts=hosts)
    assert done.returncode == 2, done.stderr
    assert (f"dflash: error: {logs / 'latest.json'} names run {recorded['run_id']!r} on {recorded['host']!r}, "
            f"which cannot name folders under {logs}") in " ".join(done.stderr.split())
    assert sorted(p.name for p in tmp_path.rglob("*") if "escaped" in p.name) == []
    assert [p.name for p in logs.iterdir()] == ["latest.json"]


def test_a_release_file_hash_that_is_a_path_reads_nothing_outside_the_cache(make_inventory, tmp_path):
    """A MANIFEST fetched from a host holds what the host wrote, and is kept under the
    id it hashes to: its entries' sha256 name cached files, so one like ../../x must be
    refused before it is read."""
    secret = tmp_path / "secret.txt"
    secret.write_text("not for a diff\n")
    logs = tmp_path / "logs"
    manifests = logs / "releases" / "manifests"
    manifests.mkdir(parents=True)
    ids = []
    for sha256 in ("0" * 64, "../../../secret.txt"):
        text = f"{sha256}  15  644  notes.txt\n"
        ids.append(hashlib.sha256(text.encode()).hexdigest()[:16])
        (manifests / ids[-1]).write_text(text)
    session = Session(str(make_inventory(tmp_path)), logs)
    try:
        store = ReleaseStore(session)
        with pytest.raises(DflashError) as refused:
            store.diff(("local", ids[0]), ("local", ids[1]))
        assert refused.value.exit_code == ExitCode.UNREACHABLE
        assert refused.value.message == (
            f"host local: the MANIFEST of release {ids[1]} ({manifests / ids[1]}) gives notes.txt the sha256 "
            "'../../../secret.txt', which is not 64 hex digits")
        with pytest.raises(DflashError) as refused:
            store.manifest("local", "../../../secret.txt")
        assert refused.value.message == "host local: refusing the release id '../../../secret.txt': not 16 hex digits"
    finally:
        session.close()


def listing(folder: str = "export", path: str = "model.safetensors", sha256: str = "a" * 64,
            twice: bool = False) -> ArtifactsReply:
    """An `artifacts` reply as a host could send it: one folder, one file (or that file twice)."""
    item = ArtifactFile(path=path, size=3, sha256=sha256, identity="1:2:3:4")
    return ArtifactsReply(run_id="r", state=RunState.SUCCEEDED,
                          folders=(ArtifactFolder(folder=folder, files=(item,) * (1 + twice), hashed_on_host=()),))


@pytest.mark.parametrize("reply, problem", [
    (listing(folder="checkpoints/.."), "refusing the listed folder 'checkpoints/..': expected export or "
                                       "checkpoints/step_NNNNNN"),
    (listing(folder="checkpoints/latest"), "refusing the listed folder 'checkpoints/latest'"),
    (listing(folder="checkpoints/step_1/.."), "refusing the listed folder 'checkpoints/step_1/..'"),
    (listing(folder=""), "refusing the listed folder ''"),
    (listing(path="../run.json"), "refusing the path 'export/../run.json': not a plain relative path"),
    (listing(path="/etc/passwd"), "refusing the path 'export//etc/passwd': not a plain relative path"),
    (listing(path=""), "refusing the path 'export/': not a plain relative path"),
    (listing(path="sub//x"), "refusing the path 'export/sub//x': not a plain relative path"),
    (listing(path="./x"), "refusing the path 'export/./x': not a plain relative path"),
    (listing(path="nul\0x"), "refusing the path 'export/nul\\x00x': not a plain relative path"),
    (listing(sha256="../../../secret"), "refusing export/'model.safetensors': its sha256 '../../../secret' is not "
                                        "64 hex digits"),
    (listing(twice=True), "refusing the listing of export: it names a file twice"),
])
def test_a_listing_that_names_a_place_outside_the_runs_folder_is_refused_naming_the_host(tmp_path, reply, problem):
    logs = RunLogs(tmp_path / "logs", RunRef("ct9", "r"))
    with pytest.raises(DflashError) as refused:
        pull.remote_files(logs, reply)
    assert refused.value.exit_code == ExitCode.UNREACHABLE
    assert refused.value.message.startswith(f"host ct9: {problem}"), refused.value.message
    assert not (tmp_path / "logs").exists()


def test_a_listed_step_folder_goes_to_its_own_local_folder(tmp_path):
    logs = RunLogs(tmp_path / "logs", RunRef("ct9", "r"))
    [(folder, [listed])] = pull.remote_files(logs, listing(folder="checkpoints/step_000012", path="sub/state.json"))
    assert (folder, listed.local) == ("checkpoints/step_000012", logs.dir / "checkpoint" / "step_000012" / "sub" /
                                      "state.json")
