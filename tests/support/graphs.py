"""The decoders' CUDA-graph bookkeeping on the CPU: a step run as a capture runs it.

model/decode_graphs.py `graphed` runs a step DECODE_WARMUP_STEPS times before its
capture records it (recording runs no kernel), and the decode then replays the recording
on the same buffers. What the CPU can check of that is the decoder's side: that the
warm-up runs, made wherever a capture happens, leave nothing a decode reads, and that the
steps are captured once and reused. Whether a replay computes what the eager step does is
the device's to prove (the `gpu` tests)."""
from __future__ import annotations

from typing import Callable

import pytest


def run_as_captured(monkeypatch: pytest.MonkeyPatch, module) -> list[Callable[[], None]]:
    """Make `module`'s `graphed` run each step as the warm-up before a capture does, and
    hand back the step itself as what replays. Returns the steps captured so far (a list
    that grows). The decoder must be told it uses graphs (`cuda_graphs = True`): on the
    CPU it turns them off."""
    from dflash_train.model.decode_graphs import DECODE_WARMUP_STEPS

    captured: list[Callable[[], None]] = []

    def graphed(step: Callable[[], None], device, pool=None) -> Callable[[], None]:
        for _ in range(DECODE_WARMUP_STEPS):
            step()
        captured.append(step)
        return step

    monkeypatch.setattr(module, "graphed", graphed)
    return captured
