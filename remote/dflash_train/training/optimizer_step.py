"""A replica's optimizer step: clipping, AdamW and the learning-rate schedule, once a step.

Three forms, one contract (`OptimizerStep.apply(grads, norm)`, after the gradient exchange
and the non-finite check, which read the norm and the losses in the step's one host sync):

* ``eager`` (compile: off): torch.optim.AdamW (foreach), `clip_grads_with_norm_`, LambdaLR.
* ``device`` (compile: default): AdamW(fused=True, capturable=True): its step counts live
  on the device; the learning rate is a device tensor the schedule fills each step
  (`fill_`, no sync); clipping scales by min(1, clip / (norm + 1e-6)) computed on the
  device. The averaged gradients are copied into gradients of its own first, as below.
* ``graph`` (compile: cudagraphs on CUDA): the device form's clip + AdamW captured once,
  at start-up, as a CUDA graph of its own, replayed every step. A graph reads fixed
  addresses, so the averaged gradients (a new buffer every step) and their norm are
  copied into static tensors first; the exchange between replicas stays outside graphs.
  Every replica copies the same averaged bits and replays the same kernels: replicas stay
  bit-identical.

AdamW's state is made lazily by its first step, and a capture must not make it (the
graph would zero the moments at every replay): `prepare` runs one step of zero
gradients at learning rate 0 before capturing, which leaves the weights as they are, and
then puts the state back as it was (fresh: zero moments and step count; resumed: the
checkpoint's). The learning rate stays a float in the param groups outside the step, so
state dicts and the schedule look as they do for the eager form; `load_state_dict`
keeps the optimizer's own implementation flags (fused, capturable, foreach), so a
checkpoint of any form loads into any other (step counts move to where the form wants them).
"""
from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator
from typing import Any, Literal

import torch

from ..config import OptimConfig
from ..model.objective import warmup_cosine

Form = Literal["eager", "device", "graph"]
# Param-group keys that say how AdamW computes, not what: the loading optimizer's own win.
IMPLEMENTATION_KEYS = ("foreach", "fused", "capturable", "differentiable")
# torch warns once per optimizer when a capturable one steps outside a capture (the device
# form) that it may be slower; the fused kernel is the same captured or not, and the
# device form exists so the CPU runs the captured form's code. Set at import, once: the
# warnings filters are process-wide and not to be changed from drafter threads.
warnings.filterwarnings("ignore", message="This instance was constructed with capturable=True", category=UserWarning)


def optimizer_form(compile_mode: str, device: str) -> Form:
    if compile_mode == "off":
        return "eager"
    return "graph" if compile_mode == "cudagraphs" and torch.device(device).type == "cuda" else "device"


def portable_state(saved: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A copy of the optimizer state dict `saved` (of any form) that `optimizer` loads as
    its own: the hyperparameters and moments of `saved`, the implementation flags of
    `optimizer`'s param groups, every learning rate a float."""
    state = copy.deepcopy(saved)
    for group, own in zip(state["param_groups"], optimizer.param_groups):
        for key in IMPLEMENTATION_KEYS:
            if key in own:
                group[key] = own[key]
        if isinstance(group.get("lr"), torch.Tensor):
            group["lr"] = float(group["lr"])
    return state


class OptimizerStep:
    def __init__(self, params: list[torch.nn.Parameter], optim: OptimConfig, total_steps: int, form: Form):
        self.params, self.form, self.grad_clip = params, form, optim.grad_clip
        on_device = {"fused": True, "capturable": True} if form != "eager" else {}
        self.optimizer = torch.optim.AdamW(params, lr=optim.lr, betas=tuple(optim.betas),
                                           weight_decay=optim.weight_decay, **on_device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           warmup_cosine(total_steps, optim.warmup_ratio))
        self._graph: torch.cuda.CUDAGraph | None = None
        if form != "eager":
            device = params[0].device
            self.lr = torch.zeros((), dtype=torch.float32, device=device)  # filled from the schedule each step
            self.norm = torch.zeros((), dtype=torch.float32, device=device)  # of the averaged gradients
            self.grads = [torch.zeros_like(p) for p in params]  # the averaged gradients, copied in

    def load_state_dict(self, optimizer: dict[str, Any], scheduler: dict[str, Any]) -> None:
        # portable_state copies: replicas on one device must not share (and each update)
        # the same moments, which Optimizer.load_state_dict would keep when device and dtype match.
        self.optimizer.load_state_dict(portable_state(optimizer, self.optimizer))
        self.scheduler.load_state_dict(scheduler)

    def apply(self, grads: list[torch.Tensor], norm: torch.Tensor) -> float:
        """Clip `grads` (whose total norm is `norm`, a 0-d tensor on their device) and take
        the AdamW step; the schedule moves on. Returns the learning rate it used."""
        lr = self.optimizer.param_groups[0]["lr"]
        if self.form == "eager":
            for param, grad in zip(self.params, grads):
                param.grad = grad
            torch.nn.utils.clip_grads_with_norm_(self.params, self.grad_clip, norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.lr.fill_(lr)
            self.norm.copy_(norm)
            torch._foreach_copy_(self.grads, grads)
            if self._graph is not None:
                self._graph.replay()
            else:
                self._clip_and_step()
        self.scheduler.step()
        return lr

    def _clip_and_step(self) -> None:
        """What the graph holds: device tensors in, no host sync, no allocation that outlives it."""
        for param, grad in zip(self.params, self.grads):
            param.grad = grad  # Python only
        torch.nn.utils.clip_grads_with_norm_(self.params, self.grad_clip, self.norm)
        with self._lr_on_device():
            self.optimizer.step()

    @contextlib.contextmanager
    def _lr_on_device(self) -> Iterator[None]:
        """The param groups' learning rate as the device tensor for one step (fused AdamW
        reads a tensor from the device; a float would be baked into a captured graph)."""
        groups = self.optimizer.param_groups
        floats = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = self.lr
        try:
            yield
        finally:
            for group, value in zip(groups, floats):
                group["lr"] = value

    def prepare(self) -> None:
        """Make AdamW's state without changing it or the weights, and capture the graph
        (form "graph"; call in the replica's thread, under the capture lock)."""
        if self.form == "eager":
            return
        state = self.optimizer.state
        saved = {p: {k: v.clone() for k, v in state[p].items()} for p in self.params if state.get(p)}
        self.lr.zero_()
        self.norm.zero_()
        torch._foreach_zero_(self.grads)
        if self.form == "graph":
            side = torch.cuda.Stream()  # warm-up off the default stream, as before any capture
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self._clip_and_step()
            torch.cuda.current_stream().wait_stream(side)
        else:
            self._clip_and_step()
        with torch.no_grad():
            for param in self.params:
                for key, value in state[param].items():
                    if param in saved:
                        value.copy_(saved[param][key])
                    else:
                        value.zero_()
        if self.form == "graph":
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=torch.cuda.Stream(), capture_error_mode="thread_local"):
                self._clip_and_step()
            torch.cuda.current_stream().synchronize()
            self._graph = graph
