"""``torch.compile`` of a stage's transformer blocks, a per-process choice (never part of the shared swarm config).

Each ``Block`` is compiled in place (``nn.Module.compile``): parameter names, state dicts, ``functional_call`` and the
outer sync see the same module; every block shares one compiled graph. "auto" compiles on CUDA only (on a CPU it was
slower, and its first call takes tens of seconds: docs/benchmarks.md). A failed compile falls back to eager, warned.

    >>> report = compile_stage(stage, "auto", device); ...; report.first_call_s  # compile time, once a forward ran
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import nn

from swarm.model.transformer import Block

logger = logging.getLogger(__name__)

CompileMode = Literal["auto", "on", "off"]
COMPILE_MODES: tuple[str, ...] = get_args(CompileMode)
COMPILE_HELP = "torch.compile of the stage's blocks: auto (on for CUDA, off on a CPU, where it does not pay), on, off."


@dataclass
class CompileReport:
    """What ``compile_stage`` did: the mode asked, whether it compiled (and how many blocks), why it fell back to
    eager (``error``), and the time of the blocks' first forward calls (tracing and compiling), once they ran."""

    mode: CompileMode
    enabled: bool = False
    blocks: int = 0
    error: str | None = None
    first_call_s: float | None = None

    def describe(self) -> str:
        if not self.enabled:
            return f"compile {self.mode}: eager" + (f" ({self.error})" if self.error else "")
        timing = "" if self.first_call_s is None else f", first call {self.first_call_s:.1f}s"
        return f"compile {self.mode}: {self.blocks} blocks compiled{timing}"

    def fields(self) -> dict[str, float]:
        """What a run's records carry: the compile time, once known (nothing when eager)."""
        return {"compile_s": self.first_call_s} if self.enabled and self.first_call_s is not None else {}


def resolve_compile(mode: CompileMode, device: torch.device) -> bool:
    """Whether ``mode`` compiles on ``device``: auto = on for CUDA only."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def compile_stage(module: nn.Module, mode: CompileMode, device: torch.device) -> CompileReport:
    """Compile ``module``'s transformer blocks in place if ``mode`` says so on ``device``; the report fills in at their
    first call (a compile that fails there runs that call and all later ones eagerly, with a warning)."""
    report = CompileReport(mode=mode)
    if not resolve_compile(mode, device):
        return report
    blocks = [m for m in module.modules() if isinstance(m, Block)]
    try:
        for block in blocks:
            block.compile()
            _first_call_timed(block, blocks, report)
    except Exception as e:  # torch.compile refused up front (an unsupported platform): every block stays eager
        _fall_back(blocks, report, e)
        return report
    report.enabled, report.blocks = bool(blocks), len(blocks)
    return report


def _first_call_timed(block: nn.Module, blocks: Sequence[nn.Module], report: CompileReport) -> None:
    """Time the compiled block's first call into ``report`` (outside the compiled code: no graph break), then call
    the compiled function directly. ``nn.Module.compile`` keeps it in ``_compiled_call_impl``, which ``__call__`` runs."""
    compiled: Callable[..., Any] | None = block._compiled_call_impl
    assert compiled is not None  # set by block.compile()

    def first_call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            out = compiled(*args, **kwargs)
        except Exception as e:  # compile errors surface here (no C compiler, no triton): eager from now on
            _fall_back(blocks, report, e)
            return block(*args, **kwargs)  # eager now; a genuine error (a bad shape) raises again
        block._compiled_call_impl = compiled
        elapsed = time.perf_counter() - start
        report.first_call_s = (report.first_call_s or 0.0) + elapsed
        if elapsed >= 1.0:  # the first block traces and compiles; the others reuse its graph
            logger.info("torch.compile: a block's first forward took %.1fs", elapsed)
        return out

    block._compiled_call_impl = first_call


def _fall_back(blocks: Sequence[nn.Module], report: CompileReport, error: Exception) -> None:
    """Every block of the stage eager again (one failed: the others, the same code, would too), said once."""
    for block in blocks:
        block._compiled_call_impl = None  # nn.Module.__call__ runs eagerly again
    logger.warning("torch.compile failed (%s: %s); the stage runs eagerly", type(error).__name__, error)
    report.enabled, report.blocks, report.error = False, 0, f"{type(error).__name__}: {error}"
