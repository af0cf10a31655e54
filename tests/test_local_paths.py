"""Names that become paths under logs/ (docs/cli.md "Local state"): a run id or host that is
not one folder name, from the command line or logs/latest.json, is refused before anything
is written, and a release id or file hash a host sent never names a file outside
logs/releases/. What `pull` makes of a host's listing is tests/test_pull.py's."""
from __future__ import annotations

import hashlib
import json

import pytest

from dflash_cli.errors import DflashError, ExitCode
from dflash_cli.release_store import ReleaseStore
from dflash_cli.session import Session
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
