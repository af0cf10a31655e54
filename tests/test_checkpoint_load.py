"""Checkpoints load with torch.load(weights_only=True): what the trainer writes is plain
data (tensors, dicts, lists, tuples, numbers, strings), so loading one runs no code from
the file; a file holding anything else is refused with a message naming it."""
from __future__ import annotations

import io
import pathlib
import random

import pytest
import torch

from dflash_train.checkpoint.folders import LoadedCheckpoint, load_checkpoint, save_checkpoint
from dflash_train.checkpoint.state import TrainingState
from dflash_train.model.objective import warmup_cosine


@pytest.fixture
def checkpoint(tmp_path) -> pathlib.Path:
    """A checkpoint after one step, with the optimizer and scheduler the replicas use."""
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(10, 0.1))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    state = TrainingState(step=1, epoch=0, batch_index=0, replicas=1, losses=[2.5])
    return save_checkpoint(tmp_path / "checkpoints", state, model, optimizer, scheduler, keep=2,
                           config_yaml="seed: 1\n")


def test_a_checkpoint_and_what_rank_0_sends_of_it_load_with_weights_only(checkpoint):
    loaded = load_checkpoint(checkpoint)
    assert loaded.state.step == 1 and loaded.scheduler["last_epoch"] == 1
    assert loaded.optimizer["state"][0]["exp_avg"].shape == (4, 4)
    # A multi-host resume sends the loaded checkpoint to the other ranks as plain data.
    buffer = io.BytesIO()
    torch.save(loaded.to_plain(), buffer)
    received = LoadedCheckpoint.from_plain(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    assert (received.folder, received.state, received.scheduler) == (loaded.folder, loaded.state, loaded.scheduler)
    assert all(torch.equal(received.weights[k], v) for k, v in loaded.weights.items())
    assert torch.equal(received.optimizer["state"][0]["exp_avg"], loaded.optimizer["state"][0]["exp_avg"])


def test_a_checkpoint_written_with_rng_states_still_loads(checkpoint):
    """Checkpoints written before the RNG states were dropped also held them: plain data too."""
    extra = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    extra["rng"] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    torch.save(extra, checkpoint / "optimizer.pt")
    assert load_checkpoint(checkpoint).scheduler == extra["scheduler"]


class _Touch:
    """Unpickling this runs code: it creates `path`."""

    def __init__(self, path: pathlib.Path):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (self.path,)


def test_an_optimizer_file_holding_code_is_refused_without_running_it(checkpoint, tmp_path):
    marker = tmp_path / "ran"
    torch.save({"optimizer": _Touch(marker), "scheduler": {}}, checkpoint / "optimizer.pt")
    with pytest.raises(ValueError, match=r"optimizer\.pt: .*not only tensors, dicts, lists, numbers and strings"):
        load_checkpoint(checkpoint)
    assert not marker.exists()
