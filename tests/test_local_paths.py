"""Names that become paths under logs/ (docs/cli.md "Local state"): a run id or host that is
not one folder name, from the command line or logs/latest.json, is refused before anything
is written. What `pull` makes of a host's listing is tests/test_pull.py's."""
from __future__ import annotations

import json

import pytest

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

