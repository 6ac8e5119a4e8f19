"""Routing: which middle stages a microbatch visits, and which replica serves each hop (pure code)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class PathConfig:
    """SkipPipe-style paths: visit round((1 − skip_ratio)·S) stages, with up to ``max_swaps`` adjacent swaps."""

    skip_ratio: float = 0.0
    max_swaps: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.skip_ratio < 1.0:
            raise ValueError(f"config field 'skip_ratio': must be in [0, 1), got {self.skip_ratio}")
        if self.max_swaps < 0:
            raise ValueError(f"config field 'max_swaps': must be non-negative, got {self.max_swaps}")
