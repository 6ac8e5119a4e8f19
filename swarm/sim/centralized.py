"""The centralized baseline: the same model trained unsplit in one process.

Every swarm result is compared against this at equal tokens. The data stream is passed in
(swarm/ never reads files itself).

    >>> model = train_centralized(cfg, batches, val, steps=300, on_log=print)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import torch

from optim.inner import clip_and_step, make_inner_optimizer
from swarm.config import SwarmConfig
from swarm.model.transformer import Transformer, loss_fn

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), (B, T) int64 each


@torch.no_grad()
def evaluate(forward: Callable[[torch.Tensor], torch.Tensor], batches: Iterable[Batch]) -> float:
    """Mean cross-entropy of ``forward(inputs) -> logits`` over held-out batches."""
    total, count = 0.0, 0
    for inputs, targets in batches:
        total += loss_fn(forward(inputs), targets).item() * inputs.shape[0]
        count += inputs.shape[0]
    return total / count


def train_centralized(
    cfg: SwarmConfig,
    batches: Iterator[Batch],
    val_batches: list[Batch],
    *,
    steps: int,
    log_every: int = 25,
    on_log: Callable[[dict[str, float]], None] = lambda record: None,
) -> Transformer:
    """AdamW (warmup + cosine over ``steps``) on batches of ``train.inner_batch`` samples."""
    model = Transformer(cfg.model)
    opt, sched = make_inner_optimizer(model.parameters(), cfg.inner)
    micro_per_step = cfg.train.inner_batch // cfg.train.microbatch_size
    tokens, start = 0, time.perf_counter()
    for step in range(1, steps + 1):
        model.train()
        step_loss = 0.0
        for _ in range(micro_per_step):
            inputs, targets = next(batches)
            loss = loss_fn(model(inputs), targets) / micro_per_step
            loss.backward()
            step_loss += loss.item()
            tokens += inputs.numel()
        clip_and_step(opt, sched, cfg.inner.grad_clip)
        if step % log_every == 0 or step == steps:
            model.eval()
            on_log({"step": step, "tokens": tokens, "train_loss": step_loss, "val_loss": evaluate(model, val_batches),
                    "elapsed_s": time.perf_counter() - start, "lr": sched.get_last_lr()[0]})
    return model
