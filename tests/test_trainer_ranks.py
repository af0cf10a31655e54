"""One run over several trainer processes (torch.distributed, gloo on CPU): each process
started as a host's supervisor starts it, with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT, on 127.0.0.1."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from support import free_port
from support.trainer import REPO
from test_trainer_runs import SMALL, launch, step_losses  # noqa: F401 - launch is a fixture

ONE_DRAFTER = SMALL.replace("drafters: [cpu, cpu]", "drafters: [cpu]")
BASE = "optim: {max_steps: 4}\neval: {num_prompts: 0}\ncheckpoint: {every: 2}\n"


def rank_envs(world_size: int) -> list[dict[str, str]]:
    port = str(free_port())
    return [{"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
             "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"} for rank in range(world_size)]


@pytest.fixture(scope="session")  # slow tests use it: they run apart from each other (conftest)
def tiny_cache(workspace):
    """SMALL's tiny target and data, built before processes that start together need them
    (builders racing each other is not what these tests are about)."""
    code = ("from pathlib import Path; from dflash_train.config import TinyTargetSpec, SyntheticDataSpec, cache_root; "
            "from dflash_train.data.tiny import ensure_tiny_assets; "
            "ensure_tiny_assets(TinyTargetSpec(), SyntheticDataSpec(num_train=64, num_eval=2), cache_root(Path('.')))")
    env = {**os.environ, "PYTHONPATH": str(REPO / "remote"), "DFLASH_WORKSPACE": str(workspace)}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120, cwd=REPO)


def launch_ranks(launch, tmp_path, config: str, run_id: str = "pair") -> list:
    """The processes of one run, one per rank, each in a run directory of its own (its host's)."""
    return [launch(config, run_dir=tmp_path / f"{run_id}-rank{rank}", run_id=run_id, env=env)
            for rank, env in enumerate(rank_envs(2))]


@pytest.mark.timeout(300)
@pytest.mark.slow(seconds=5, why="two trainer processes joined by torch.distributed, and a one-process run")
def test_two_ranks_train_as_one_process_with_both_replicas(launch, tmp_path, tiny_cache):
    one = launch(SMALL + BASE, run_id="one")  # one process, two drafter replicas
    rank0, rank1 = launch_ranks(launch, tmp_path, ONE_DRAFTER + BASE)  # two processes, one replica each
    for run in (one, rank0, rank1):
        assert run.wait(250) == 0, run.log()[-3000:]
    # The same global batch: replica g of the run trains on the same micro-batches, and the
    # averaged gradients are the same sum (two addends: a + b == b + a exactly; more would
    # only be summed in another order), so the losses agree to float32 rounding.
    assert sorted(step_losses(rank0)) == [1, 2, 3, 4]
    assert step_losses(rank0) == pytest.approx(step_losses(one), rel=1e-5)
    assert rank1.events("step") == []  # rank 0 reports the run's steps
    assert [(e["rank"], e["world_size"]) for e in rank0.events("ready") + rank1.events("ready")] == [(0, 2), (1, 2)]
    for rank, run in enumerate((rank0, rank1)):  # the join is a start-up phase, as `watch` shows it
        joined = [e for e in run.events("startup") if e["phase"] == "join peers" and e["state"] != "alive"]
        assert [(e["state"], e["rank"], e["world_size"], e["backend"]) for e in joined] == [
            ("started", rank, 2, "gloo"), ("done", rank, 2, "gloo")]
        assert f"start-up: join peers {joined[-1]['duration_s']:.1f} s" in run.log()
    # Every replica of both ranks holds the same weights; each rank saw every rank's checksums.
    (replicas0,), (replicas1,) = rank0.events("replicas"), rank1.events("replicas")
    assert replicas0["sha256_by_rank"] == replicas1["sha256_by_rank"]
    assert len({c for sums in replicas0["sha256_by_rank"] for c in sums}) == 1
    assert replicas0["sha256_by_rank"] == [replicas0["sha256"], replicas1["sha256"]]
    # Rank 0 alone writes checkpoints and the export.
    assert sorted(p.name for p in (rank0.run_dir / "checkpoints").glob("step_*")) == ["step_000002", "step_000004"]
    assert (rank0.run_dir / "export" / "model.safetensors").exists()
    assert not (rank1.run_dir / "checkpoints").exists() and not (rank1.run_dir / "export").exists()
    state = json.loads((rank0.run_dir / "checkpoints" / "step_000002" / "state.json").read_text())
    assert (state["replicas"], state["world_size"]) == (2, 2)

    # Resume: the data order depends on the replicas in all, not on how processes hold them.
    # The checkpoint is on rank 0's host only: rank 0 reads it and sends it to the others.
    resume = f"checkpoint: {{every: 2, resume: {rank0.run_dir / 'checkpoints' / 'step_000002'}}}\n"
    config = SMALL + BASE.replace("checkpoint: {every: 2}\n", resume)
    same_layout = launch_ranks(launch, tmp_path, config.replace("drafters: [cpu, cpu]", "drafters: [cpu]"),
                               run_id="resumed-2x1")
    other_layout = launch(config, run_id="resumed-1x2")
    refused = launch(config.replace("drafters: [cpu, cpu]", "drafters: [cpu]"), run_id="resumed-1x1")
    for run in (*same_layout, other_layout):
        assert run.wait(200) == 0, run.log()[-3000:]
    assert refused.wait(200) == 1
    assert step_losses(same_layout[0]) == {s: step_losses(rank0)[s] for s in (3, 4)}  # exactly
    for run in (*same_layout, other_layout):  # read by rank 0, received by rank 1
        (weights,) = [e for e in run.events("startup") if e["phase"] == "drafter weights" and e["state"] == "done"]
        assert (weights["resume"], weights["step"]) == (True, 2)
    resumed = step_losses(other_layout)
    assert sorted(resumed) == [3, 4]
    assert resumed == pytest.approx({s: step_losses(rank0)[s] for s in (3, 4)}, rel=1e-5)
    (error,) = refused.errors()
    assert "2 drafter replica(s) in all (2 process(es)); this run has 1" in error["message"], error["message"]


def failed_ranks(launch, tmp_path, fault: str, run_id: str) -> list:
    """Both ranks of a run with `fault` (a faults: entry), once both exited 1."""
    ranks = launch_ranks(launch, tmp_path, ONE_DRAFTER + "optim: {max_steps: 8}\neval: {num_prompts: 0}\n"
                         f"faults: [{fault}]\n", run_id=run_id)
    for run in reversed(ranks):  # rank 0 exits within seconds of rank 1; the bound is the CI machine's
        assert run.wait(150) == 1, run.log()[-3000:]
    return ranks


@pytest.mark.timeout(200)
@pytest.mark.slow(seconds=2, why="two trainer processes joined by torch.distributed")
def test_a_drafter_failing_on_rank_1_stops_rank_0_with_peer_failed(launch, tmp_path, tiny_cache):
    rank0, rank1 = failed_ranks(launch, tmp_path, "{thread: drafter-0, at: 'step:3', kind: raise, depth: 5, rank: 1}",
                                "fails")
    root, coordinator = rank1.errors()
    assert (root["thread"], root["step"], root["exc_type"]) == ("drafter-0", 3, "InjectedFault")
    assert coordinator["exc_type"] == "ThreadFailed"
    (peer,) = rank0.errors()  # one record: the root cause is the other rank's
    assert peer["exc_type"] == "PeerFailed"
    assert peer["detail"] == {"peer_rank": 1, "peer_exc_type": "InjectedFault",
                              "peer_message": "injected fault in drafter-0 at step 3 (the cause is 5 frames deep)",
                              "silence_s": None}
    assert "injecting fault" not in rank0.log()  # the fault fired on rank 1 only
    assert all(e["step"] < 3 for e in rank0.events("step"))
    for run in (rank0, rank1):
        assert run.events("done")[-1]["exit_code"] == 1
    assert not (rank0.run_dir / "export").exists()


@pytest.mark.timeout(120)
@pytest.mark.slow(seconds=5, why="a trainer process waiting for its peers until the rendezvous times out")
def test_a_rank_that_finds_no_peers_fails_naming_the_rendezvous(launch, tmp_path, tiny_cache):
    env = rank_envs(2)[1]  # rank 1 alone: rank 0 never comes
    run = launch(ONE_DRAFTER + "distributed: {join_timeout_s: 3}\n", run_id="alone", env=env)
    assert run.wait(100) == 1, run.log()[-3000:]
    (error,) = run.errors()
    assert error["exc_type"] == "JoinFailed" and error["phase"] == "startup"
    joining = [e for e in run.events("startup") if e["phase"] == "join peers" and e["state"] != "alive"]
    assert [e["state"] for e in joining] == ["started", "failed"] and joining[-1]["duration_s"] >= 2.5
    assert error["message"].startswith(f"rank 1 could not join the process group of 2 at "
                                       f"127.0.0.1:{env['MASTER_PORT']} within 3s"), error["message"]


@pytest.mark.timeout(200)
@pytest.mark.slow(seconds=15, why="two trainer processes joined by torch.distributed")
def test_a_non_finite_step_on_rank_1_is_found_by_every_rank_at_that_step(launch, tmp_path, tiny_cache):
    rank0, rank1 = failed_ranks(launch, tmp_path, "{thread: drafter-0, at: 'step:3', kind: nonfinite, rank: 1}",
                                "nonfinite")
    root = rank1.errors()[0]
    assert (root["thread"], root["step"], root["exc_type"]) == ("drafter-0", 3, "NonFiniteStep")
    assert root["detail"]["replica"] == 1 and root["detail"]["losses"][1] == "nan"  # replica 1 of the run
    assert root["message"].startswith("step 3: the loss of drafter-0 of rank 1 is nan")
    (peer,) = rank0.errors()  # rank 0 read the same losses: it stops at step 3 too, naming rank 1
    assert peer["exc_type"] == "PeerFailed" and peer["step"] == 3
    assert (peer["detail"]["peer_rank"], peer["detail"]["peer_exc_type"]) == (1, "NonFiniteStep")
    assert [e["step"] for e in rank0.events("step")] == [1, 2]
    assert not (rank0.run_dir / "export").exists()


@pytest.mark.timeout(200)
@pytest.mark.slow(seconds=9, why="two trainer processes joined by torch.distributed")
def test_sigterm_on_one_rank_stops_both(launch, tmp_path, tiny_cache):
    rank0, rank1 = launch_ranks(launch, tmp_path, ONE_DRAFTER + "optim: {epochs: 100}\neval: {num_prompts: 0}\n",
                                run_id="stopped")
    rank0.wait_for("a few steps", lambda: len(rank0.events("step")) >= 3, 150)
    rank1.proc.send_signal(signal.SIGTERM)
    assert rank1.wait(100) == 143, rank1.log()[-3000:]
    assert rank0.wait(100) == 143, rank0.log()[-3000:]  # rank 1's stop record stops rank 0 as a signal would
    assert rank0.errors() == [] and rank1.errors() == []  # a stop is not a failure
    assert "rank 1 stopped (SIGTERM): stopping" in rank0.log()
    assert len(rank0.events("step")) < 400  # of 400: stopped, not finished
    assert (rank0.run_dir / "checkpoints" / "latest").exists()  # rank 0 alone checkpoints on a stop
    assert not (rank1.run_dir / "checkpoints").exists()


# --- in process -------------------------------------------------------------------------

def test_a_fault_with_a_rank_fires_in_that_rank_only(tmp_path):
    from dflash_schema import SchemaError
    from dflash_train.config import load_job_config
    from dflash_train.faults import FaultInjector, InjectedFault

    path = tmp_path / "train.yaml"
    path.write_text(SMALL + "faults: [{thread: drafter-0, at: 'step:2', kind: raise, rank: 1},\n"
                            "         {thread: drafter-1, at: 'step:2', kind: raise}]\n")
    faults = load_job_config(path).faults
    for rank, fired in ((0, ["drafter-1"]), (1, ["drafter-0", "drafter-1"])):
        injector, seen = FaultInjector(faults, rank), []
        for thread in ("drafter-0", "drafter-1"):
            try:
                injector.fire(thread, 2)
            except InjectedFault:
                seen.append(thread)
        assert seen == fired, rank
    path.write_text(SMALL + "faults: [{thread: drafter-0, at: 'step:2', kind: raise, rank: -1}]\n")
    with pytest.raises(SchemaError, match="rank counts from 0"):
        load_job_config(path)
    path.write_text(SMALL + "distributed: {timeout_s: 0}\n")
    with pytest.raises(SchemaError, match="distributed: .*must be positive"):
        load_job_config(path)


def test_the_exchange_gives_every_replica_the_same_mean_and_every_fact():
    import torch
    from dflash_train.devices import Fence
    from dflash_train.training.distributed import Layout
    from dflash_train.training.gradients import GradientExchange, Posted

    generator = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (7,), (2, 2, 2)]
    posted = [Posted([torch.randn(s, generator=generator) for s in shapes],
                     torch.tensor([float(r), 10.0 + r, 20.0 + r]), Fence("cpu"), "cpu") for r in range(3)]
    averaged = GradientExchange(Layout(local_replicas=3), None).average(posted)
    for i in range(len(shapes)):
        # the one-process sum as it always was: in replica order, then divided
        expected = (posted[0].grads[i] + posted[1].grads[i] + posted[2].grads[i]) / 3
        assert all(torch.equal(a.grads[i], expected) for a in averaged)
    assert all(torch.equal(a.facts, torch.stack([p.facts for p in posted])) for a in averaged)
    # every replica owns its copy: clipping one replica's gradients in place leaves the others' alone
    averaged[1].grads[0].mul_(0.5)
    assert torch.equal(averaged[0].grads[0], averaged[2].grads[0])
    assert not torch.equal(averaged[0].grads[0], averaged[1].grads[0])
