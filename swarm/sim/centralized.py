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
from dataclasses import dataclass, field

import torch

from compress.transfer import host_copy
from swarm.cli_fields import cli
from swarm.config import SwarmConfig
from swarm.errors import ConfigError
from swarm.hardware import CPU, Precision, compute_precision, peak_gpu_memory
from swarm.model.compiling import COMPILE_HELP, COMPILE_MODES, CompileMode, compile_stage
from swarm.model.stages import EdgeStage, middle_stages
from swarm.model.step import InnerStep, microbatch_loss, run_microbatch
from swarm.model.transformer import Transformer, loss_fn

Batch = tuple[torch.Tensor, torch.Tensor]  # (inputs, targets), (B, T) int64 each


@dataclass(kw_only=True)
class CentralizedRun:
    """How long the baseline trains, how often it logs, whether it compiles: ``swarmloco train-local``'s options (each
    field's ``cli`` metadata) and ``train_centralized``'s defaults."""

    steps: int = field(default=300, metadata=cli("Optimizer steps (each train.inner_batch samples).", min=1))
    log_every: int = field(default=25, metadata=cli("Evaluate and log every N steps.", min=1))
    compile: CompileMode = field(default="auto", metadata=cli(COMPILE_HELP))

    def __post_init__(self) -> None:
        if self.steps < 1 or self.log_every < 1:
            raise ConfigError("steps", f"steps and log_every must be positive, got {self.steps}, {self.log_every}")
        if self.compile not in COMPILE_MODES:
            raise ConfigError("compile", f"must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")


DEFAULT_RUN = CentralizedRun()


@torch.no_grad()
def evaluate(
    forward: Callable[[torch.Tensor], torch.Tensor],
    batches: Iterable[Batch],
    *,
    device: torch.device = CPU,
    precision: Precision = "fp32",
) -> float:
    """Mean cross-entropy of ``forward(inputs) -> logits`` over held-out batches (moved to ``device``)."""
    total, count = torch.zeros((), device=device), 0
    for inputs, targets in batches:
        with compute_precision(device, precision):
            logits = forward(inputs.to(device))
        total += loss_fn(logits, targets.to(device)).detach() * inputs.shape[0]
        count += inputs.shape[0]
    return float(total) / count  # read once: the host waits for the device here only


def train_microbatch(model: Transformer, batch: Batch, *, num_stages: int, inner_batch: int) -> float:
    """The swarm's microbatch step through all ``num_stages`` stages of ``model`` in order; gradients accumulate in ``model``."""
    return run_microbatch(EdgeStage(model), middle_stages(model, num_stages), batch, inner_batch=inner_batch)


def to_device(batch: Batch, device: torch.device) -> Batch:
    """A batch on ``device``: through pinned memory without blocking on CUDA (a pageable copy waits for the GPU to
    finish all work queued before it), plainly elsewhere."""
    if not host_copy(device).pinned:  # the codecs' one choice of how host bytes cross to a device
        return batch[0].to(device), batch[1].to(device)
    inputs, targets = (t.pin_memory().to(device, non_blocking=True) for t in batch)
    return inputs, targets


def train_centralized(
    cfg: SwarmConfig,
    batches: Iterator[Batch],
    val_batches: list[Batch],
    *,
    steps: int,
    log_every: int = DEFAULT_RUN.log_every,
    on_log: Callable[[dict[str, float]], None] = lambda record: None,
    device: torch.device = CPU,
    compile: CompileMode = DEFAULT_RUN.compile,
) -> Transformer:
    """``steps`` inner steps of AdamW (``cfg.inner``'s warmup + cosine schedule) on ``train.inner_batch`` samples each,
    on ``device`` in ``train.precision``, its blocks compiled as ``compile`` says (``swarm/model/compiling.py``).

    Losses stay on the device until a logging window ends (one read then); the inner step reads its gradient norm."""
    model = Transformer(cfg.model).to(device)
    compiled = compile_stage(model, compile, device)
    edge, middles = EdgeStage(model), middle_stages(model, cfg.stages.num_stages)  # views of model's parameters
    precision = cfg.train.precision
    inner = InnerStep(model.parameters(), cfg.inner, inner_batch=cfg.train.inner_batch)
    tokens, start, eval_s = 0, time.perf_counter(), 0.0
    for step in range(1, steps + 1):
        model.train()
        losses = []
        while inner.steps < step:
            inputs, targets = to_device(next(batches), device)
            with compute_precision(device, precision):
                losses.append(microbatch_loss(edge, middles, (inputs, targets), inner_batch=cfg.train.inner_batch))
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
                    "train_loss": float(torch.stack(losses).mean()),  # the window's one read of its losses
                    "val_loss": val_loss,
                    "elapsed_s": elapsed,
                    "tokens_per_s": tokens / max(elapsed, 1e-9),
                    "lr": inner.lr,
                    "eval_s": eval_s,  # of elapsed_s, the validation passes': train time is the rest
                    **compiled.fields(),  # compile_s: the blocks' first forward (tracing and compiling), when compiled
                    **peak_gpu_memory(),
                }
            )
    return model
