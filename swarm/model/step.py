"""One microbatch's training step, defined once for the swarm, the simulator and the centralized baseline.

The runtime, the simulator (``swarm/sim/simulate.py``) and the centralized baseline (``swarm/sim/centralized.py``)
all run a microbatch as these calls, in one order — embed, stage forwards, head backward, stage backwards, embed
backward, ``InnerStep.add`` — so they compute the same gradients (``tests/test_training_step.py``). The six steps
and how the trainer and servers split them: docs/architecture.md, model/.

    >>> loss = run_microbatch(edge, middles, (inputs, targets), inner_batch=cfg.train.inner_batch)  # then inner.add(B)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

import torch
from torch import nn

from optim.config import InnerOptimConfig
from optim.inner import clip_and_step, make_inner_optimizer
from swarm.model.stages import EdgeStage, MiddleStage
from swarm.model.transformer import loss_fn

# How a stage copy's weights change outside its inner steps (``Holder.exclusive``). "moved": an outer round's install,
# θ ← θ + (θ_global − θ_snapshot), keeps the progress made since the snapshot, so the gradients of work begun before
# it still apply, one move stale, as a microbatch in flight across an inner step is (a stage server differentiates
# the weights that work's forward ran on, stashed). "replaced": a download; the old weights are gone and the
# gradients of work begun on them are dropped.
WeightChange = Literal["none", "moved", "replaced"]

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), (B, T) int64 each
Gradients = Sequence[torch.Tensor | None]  # one per trainable parameter, in ``trainable``'s order; None where unused
# what the receiver of a tensor gets: (kind "activations" | "activation_gradients", tensor, token ids) → decoded tensor
Send = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]


def loss_weight(samples: int, inner_batch: int) -> float:
    """Weight of a microbatch's mean loss in its backward: its share of the inner batch."""
    return samples / inner_batch


def embed(edge: EdgeStage, tokens: torch.Tensor) -> torch.Tensor:
    """Step 1: (B, T) token ids → (B, T, d), with the graph ``embed_backward`` runs back through."""
    with torch.enable_grad():
        h: torch.Tensor = edge.embed(tokens)
    return h


@torch.no_grad()
def stage_forward(
    stage: MiddleStage, x: torch.Tensor, weights: Mapping[str, torch.Tensor] | None = None
) -> torch.Tensor:
    """Step 2 on a stage server: no graph waits in memory until the backward (it recomputes). ``weights``: trainable
    parameters by name to run at instead of the stage's current ones (a stashed copy: a backward probe's forward)."""
    y: torch.Tensor = stage(x) if weights is None else torch.func.functional_call(stage, dict(weights), (x,))
    return y


def head_backward(
    edge: EdgeStage, h: torch.Tensor, targets: torch.Tensor, *, inner_batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3: the microbatch's mean loss (a 0-d tensor on the device), and the gradient w.r.t. the last hidden state
    ``h`` of its weighted backward."""
    loss, grad_h, grads = head_loss_gradients(edge, h, targets, inner_batch=inner_batch)
    add_gradients(edge, grads)
    return loss, grad_h


def head_loss_gradients(
    edge: EdgeStage, h: torch.Tensor, targets: torch.Tensor, *, inner_batch: int
) -> tuple[torch.Tensor, torch.Tensor, Gradients]:
    """Step 3 held apart: the loss (detached, 0-d, on the device: reading it waits for the GPU, so a caller reads
    its losses once per logging window), the gradient w.r.t. ``h``, and the head's parameter gradients (in
    ``trainable(edge)`` order, None for the embedding), not yet accumulated (``add_gradients`` does)."""
    h = h.detach().requires_grad_()
    params = trainable(edge)
    with torch.enable_grad():
        loss = loss_fn(edge.head(h), targets)
        grad_h, *grads = torch.autograd.grad(
            loss * loss_weight(targets.shape[0], inner_batch), [h, *params], allow_unused=True
        )
    return loss.detach(), grad_h, grads


def head_gradients(
    edge: EdgeStage, h: torch.Tensor, targets: torch.Tensor, *, inner_batch: int
) -> tuple[float, torch.Tensor, Gradients]:
    """``head_loss_gradients`` with the loss read as a float (a host synchronisation)."""
    loss, grad_h, grads = head_loss_gradients(edge, h, targets, inner_batch=inner_batch)
    return float(loss), grad_h, grads


def stage_backward(
    stage: MiddleStage, x: torch.Tensor, grad: torch.Tensor, *, y: torch.Tensor | None = None
) -> torch.Tensor:
    """Step 4: parameter gradients accumulate, and the gradient w.r.t. the stage's input ``x`` is returned.

    ``y`` is the forward's output when its graph was kept (in process); without it the forward is
    recomputed from ``x`` (a stage server, which keeps no graph between the two calls).
    """
    grad_x, grads = stage_gradients(stage, x, grad) if y is None else graph_gradients(stage, x, y, grad)
    add_gradients(stage, grads)
    return grad_x


def trainable(stage: nn.Module) -> list[nn.Parameter]:
    return [p for p in stage.parameters() if p.requires_grad]


def stage_gradients(
    stage: MiddleStage, x: torch.Tensor, grad: torch.Tensor, *, weights: Mapping[str, torch.Tensor] | None = None
) -> tuple[torch.Tensor, Gradients]:
    """Step 4 recomputed from ``x``, held apart: the gradient w.r.t. ``x`` and this microbatch's parameter
    gradients (in ``trainable(stage)`` order, None where unused), not yet accumulated.

    A stage server screens them before ``add_gradients`` counts them, so one bad microbatch
    cannot poison the gradients the others accumulated. ``weights`` (trainable parameters by name) are the values
    to differentiate at instead of the stage's current ones: a stashed copy of the weights the forward ran on.
    """
    x = x.detach().requires_grad_()
    params: Sequence[torch.Tensor]
    run: Callable[[torch.Tensor], torch.Tensor]
    if weights is None:
        params, run = trainable(stage), stage
    else:
        names = [name for name, p in stage.named_parameters() if p.requires_grad]  # trainable(stage)'s order
        params = [weights[name].detach().requires_grad_() for name in names]
        run = lambda x: torch.func.functional_call(stage, dict(zip(names, params, strict=True)), (x,))
    with torch.enable_grad():
        grad_x, *grads = torch.autograd.grad(run(x), [x, *params], grad, allow_unused=True)
    return grad_x, grads


def stage_forward_graph(stage: MiddleStage, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 2 keeping its graph for ``graph_gradients``: the input as the graph's leaf (requires grad) and the output.

    A stage server keeps it instead of recomputing in the backward while its memory budget allows (``--keep-graph-mb``).
    """
    x = x.detach().requires_grad_()
    with torch.enable_grad():
        y: torch.Tensor = stage(x)
    return x, y


def graph_gradients(
    stage: MiddleStage, x: torch.Tensor, y: torch.Tensor, grad: torch.Tensor
) -> tuple[torch.Tensor, Gradients]:
    """Step 4 from ``stage_forward_graph``'s kept graph, held apart as ``stage_gradients`` holds its own: the gradient
    w.r.t. ``x`` and the parameter gradients (``trainable(stage)`` order), not yet accumulated. The graph is freed.

    Only while the weights have not moved since that forward: an inner step or install updates them in place, and
    autograd refuses the saved tensors it changed (the caller recomputes with ``stage_gradients`` then).
    """
    grad_x, *grads = torch.autograd.grad(y, [x, *trainable(stage)], grad.to(y.dtype), allow_unused=True)
    return grad_x, grads


def add_gradients(stage: nn.Module, grads: Gradients) -> None:
    """Accumulate ``stage_gradients``' (or ``head_gradients``') parameter gradients into ``.grad``, as ``backward``
    would have."""
    with torch.no_grad():
        for param, grad in zip(trainable(stage), grads, strict=True):
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad
            else:
                param.grad += grad


def embed_backward(h0: torch.Tensor, grad: torch.Tensor) -> None:
    """Step 5: the embedding's parameter gradients."""
    torch.autograd.backward(h0, grad)  # h0.backward(grad), typed


def no_wire(kind: str, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``Send`` of a process that is the whole pipeline: the receiver gets the tensor itself."""
    return x.detach()


def run_microbatch(
    edge: EdgeStage, path: Sequence[MiddleStage], batch: Batch, *, inner_batch: int, send: Send = no_wire
) -> float:
    """``microbatch_loss`` with the loss read as a float (a host synchronisation)."""
    return float(microbatch_loss(edge, path, batch, inner_batch=inner_batch, send=send))


def microbatch_loss(
    edge: EdgeStage, path: Sequence[MiddleStage], batch: Batch, *, inner_batch: int, send: Send = no_wire
) -> torch.Tensor:
    """Steps 1-5 in one process, through ``path``'s stages in order; returns the microbatch's mean loss, a detached 0-d
    tensor on the device (no host synchronisation: read it once per logging window).

    Every boundary (before the first stage, after each one, both ways) goes through ``send``: with
    an empty path the head still receives the embedding through it. Graphs are kept (no recompute).
    """
    inputs, targets = batch
    h0 = embed(edge, inputs)  # (B, T, d)
    h, kept = send("activations", h0, inputs), []
    for stage in path:
        x = h.requires_grad_()
        with torch.enable_grad():
            y = stage(x)
        kept.append((stage, x, y))
        h = send("activations", y, inputs)
    loss, grad = head_backward(edge, h, targets, inner_batch=inner_batch)
    grad = send("activation_gradients", grad, inputs)
    for stage, x, y in reversed(kept):
        grad = send("activation_gradients", stage_backward(stage, x, grad, y=y), inputs)
    embed_backward(h0, grad)
    return loss


class InnerStep:
    """Step 6 for one stage copy (or a whole model): its AdamW and schedule, and the samples whose gradients it holds.

    >>> inner = InnerStep(stage.parameters(), cfg.inner, inner_batch=cfg.train.inner_batch)
    >>> inner.add(16)  # after a microbatch's backward: True when it stepped
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        cfg: InnerOptimConfig,
        *,
        inner_batch: int,
        start_step: int = 0,
        lr_scale: float = 1.0,
    ) -> None:
        # start_step: a copy that joins mid-run starts at the swarm's point of the lr schedule;
        # lr_scale: CheckFree's ×1.1 on a stage rebuilt from its neighbours (swarm/recovery/checkfree.py)
        self.optimizer, self.scheduler = make_inner_optimizer(params, cfg, start_step=start_step, lr_scale=lr_scale)
        self.inner_batch, self.grad_clip = inner_batch, cfg.grad_clip
        self.samples = 0  # whose gradients are accumulated since the last step
        self.steps = 0  # taken by this copy
        self.skipped = 0  # steps skipped for a non-finite gradient norm (their gradients dropped)
        self.grad_norm = 0.0  # before clipping, at the last step taken: always finite (records refuse NaN)
        # called with ``steps`` just before a step moves the weights (a stage server stashes them: ``WeightStash``)
        self.before_step: list[Callable[[int], None]] = []

    def add(self, samples: int, *, step_when_due: bool = True) -> bool:
        """Count ``samples`` whose (loss-weighted) gradients were just accumulated; step once an inner batch is in
        (True when it stepped).

        ``step_when_due=False`` only counts (DDP steps on the group's mean gradient every tick instead).
        """
        self.samples += samples
        if not step_when_due or self.samples < self.inner_batch:
            return False
        return self.step()

    def step(self) -> bool:
        """Clip, step, advance the schedule and zero the gradients now; False if a non-finite norm skipped the step."""
        for hook in self.before_step:
            hook(self.steps)
        norm = clip_and_step(self.optimizer, self.scheduler, self.grad_clip)
        self.samples = 0
        if not math.isfinite(norm):
            self.skipped += 1
            return False
        self.grad_norm, self.steps = norm, self.steps + 1
        return True

    def drop(self) -> None:
        """Zero the accumulated gradients without stepping (the weights they were computed on were just replaced)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.samples = 0

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])
