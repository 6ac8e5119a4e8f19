"""The centralized baseline: the same model trained in one process, with one optimizer.

Every swarm result is compared against this at equal tokens. A microbatch takes the swarm's own
step (``swarm/model/step.py``) through all stages in order, with no codec; the inner step clips
the whole model's gradient at once (the swarm clips each stage's: the one intended difference).
The data stream is passed in (swarm/ never reads files itself).

    >>> model = train_centralized(cfg, batches, val, steps=300, on_log=print)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import torch

from swarm.config import SwarmConfig
from swarm.hardware import CPU, Precision, compute_precision, peak_gpu_memory
from swarm.model.stages import EdgeStage, middle_stages
from swarm.model.step import InnerStep, run_microbatch
from swarm.model.transformer import Transformer, loss_fn

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), (B, T) int64 each


@torch.no_grad()
def evaluate(
    forward: Callable[[torch.Tensor], torch.Tensor],
    batches: Iterable[Batch],
    *,
    device: torch.device = CPU,
    precision: Precision = "fp32",
) -> float:
    """Mean cross-entropy of ``forward(inputs) -> logits`` over held-out batches (moved to ``device``)."""
    total, count = 0.0, 0
    for inputs, targets in batches:
        with compute_precision(device, precision):
            logits = forward(inputs.to(device))
        total += loss_fn(logits, targets.to(device)).item() * inputs.shape[0]
        count += inputs.shape[0]
    return total / count


def train_microbatch(model: Transformer, batch: Batch, *, num_stages: int, inner_batch: int) -> float:
    """The swarm's microbatch step through all ``num_stages`` stages of ``model`` in order; gradients accumulate in ``model``."""
    return run_microbatch(EdgeStage(model), middle_stages(model, num_stages), batch, inner_batch=inner_batch)


def train_centralized(
    cfg: SwarmConfig,
    batches: Iterator[Batch],
    val_batches: list[Batch],
    *,
    steps: int,
    log_every: int = 25,
    on_log: Callable[[dict[str, float]], None] = lambda record: None,
    device: torch.device = CPU,
) -> Transformer:
    """``steps`` inner steps of AdamW (``cfg.inner``'s warmup + cosine schedule) on ``train.inner_batch`` samples each,
    on ``device`` in ``train.precision``."""
    model = Transformer(cfg.model).to(device)
    precision = cfg.train.precision
    inner = InnerStep(model.parameters(), cfg.inner, inner_batch=cfg.train.inner_batch)
    tokens, start, eval_s = 0, time.perf_counter(), 0.0
    for step in range(1, steps + 1):
        model.train()
        losses = []
        while inner.steps < step:
            inputs, targets = next(batches)
            with compute_precision(device, precision):
                losses.append(
                    train_microbatch(
                        model,
                        (inputs.to(device), targets.to(device)),
                        num_stages=cfg.stages.num_stages,
                        inner_batch=cfg.train.inner_batch,
                    )
                )
            inner.add(inputs.shape[0])
            tokens += inputs.numel()
        if step % log_every == 0 or step == steps:
            model.eval()
            eval_start = time.perf_counter()
            val_loss = evaluate(model, val_batches, device=device, precision=precision)
            eval_s += time.perf_counter() - eval_start
            elapsed = time.perf_counter() - start
            on_log(  # a swarm trainer's progress record has these fields too (docs/architecture.md, "Metrics files")
                {
                    "step": step,
                    "tokens": tokens,
                    "train_loss": sum(losses) / len(losses),
                    "val_loss": val_loss,
                    "elapsed_s": elapsed,
                    "tokens_per_s": tokens / max(elapsed, 1e-9),
                    "lr": inner.lr,
                    "eval_s": eval_s,  # of elapsed_s, the validation passes': train time is the rest
                    **peak_gpu_memory(),
                }
            )
    return model
