"""Moving tensors between threads and devices safely.

On CUDA every worker thread runs on its own stream, so the target's forward of the next
batch overlaps the drafters' steps. A tensor handed from one thread to another carries a
`Fence` (a CUDA event recorded on the producer's stream); the consumer's stream waits on
it, and `record_stream` keeps the caching allocator from reusing the memory while the
consumer still reads it. On CPU all of this is a no-op.

A CUDA graph's warm-up and capture touch process-wide CUDA state (a device synchronize,
the cuBLAS workspace map, the allocator's capture pools): every capture, of a train step,
an optimizer step or a decode step, holds `CAPTURE_LOCK`, one thread at a time.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

CAPTURE_LOCK = threading.Lock()


def is_cuda(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def canonical(device: str) -> str:
    """"cuda" -> "cuda:0", so equal devices compare equal."""
    return "cuda:0" if device == "cuda" else device


@contextlib.contextmanager
def thread_stream(device: str) -> Iterator[None]:
    """Run the calling thread's CUDA work on a stream of its own."""
    if not is_cuda(device):
        yield
        return
    torch.cuda.set_device(torch.device(device))
    with torch.cuda.stream(torch.cuda.Stream(device=device)):
        yield


class Fence:
    """The point the producer's stream had reached when the fence was made."""

    def __init__(self, device: str | torch.device):
        self._event = None
        if is_cuda(device):
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))

    def wait(self, device: str | torch.device, *tensors: torch.Tensor) -> None:
        """Make the current stream of `device` wait; mark `tensors` as used by it."""
        if self._event is None or not is_cuda(device):
            return
        stream = torch.cuda.current_stream(device)
        stream.wait_event(self._event)
        for tensor in tensors:
            if tensor.is_cuda:
                tensor.record_stream(stream)


def handoff(tensor: torch.Tensor, device: str) -> torch.Tensor:
    """An ordinary (non-inference) copy of `tensor` on `device`, for another thread.

    Tensors made under inference_mode cannot be saved for backward, so the consumer
    always gets a copy made outside it. torch runs a copy to another device on the
    source device's current stream (the producer's), so the producer's fence, recorded
    after it, covers it too."""
    with torch.inference_mode(False):
        if tensor.device == torch.device(device):
            return tensor.clone()
        return tensor.to(device)
