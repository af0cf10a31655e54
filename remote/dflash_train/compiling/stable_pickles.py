"""Pickles of torch objects that are the same in every process (`stable_cache_keys`).

Its own module, importing torch alone: what it registers names `memory_format` here, so
every process that unpickles such a pickle (a later trainer, Inductor's compile workers,
which inherit the trainer's PYTHONPATH) imports this and nothing heavier.
"""
from __future__ import annotations

import copyreg

import torch


def stable_cache_keys() -> None:
    """Make a torch.memory_format pickle the same in every process, as Inductor's and
    AOTAutograd's cache keys need: they hash pickles of the example inputs' metadata, which
    holds the memory format, and pickle names an object without a __module__ (a memory
    format) after the first module in sys.modules through which `torch.<name>` reaches it.
    So a trainer forked from the warm interpreter, whose imports ran in another order than
    an exec'd trainer's, hashed other keys and missed every entry the exec'd runs had
    written. Registered with copyreg, whose table those picklers copy; once per process,
    before anything compiles."""
    copyreg.pickle(torch.memory_format, _reduce_memory_format)


def memory_format(name: str) -> torch.memory_format:
    """torch.<name>: what a memory format pickled by stable_cache_keys unpickles to."""
    value = getattr(torch, name)
    if not isinstance(value, torch.memory_format):
        raise ValueError(f"torch.{name} is no memory format")
    return value


def _reduce_memory_format(value: torch.memory_format):
    return memory_format, (str(value).removeprefix("torch."),)
