"""Link-adaptive codec choice: compress hard only where the link is slow.

A hop costs the time to code the tensor (encode at the sender, decode at the receiver) plus the
time its frame spends on the link. On a fast link the cheapest codec to compute wins; on a slow
one the bytes dominate and a stronger codec pays for its compute. ``choose_codec`` takes the
most faithful codec that fits the per-hop time budget, so only slow links lose precision.

    >>> codecs = [get_codec(n) for n in ("fp32", "bf16", "int8", "int4")]
    >>> choose_codec(codecs, (16, 128, 128), bandwidth=1e9, budget_s=0.05).name   # 'fp32' (datacenter link)
    >>> choose_codec(codecs, (16, 128, 128), bandwidth=2e6, budget_s=0.2).name     # 'int8' (16 Mbit/s)
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from compress.codecs import Codec

# fp32 bytes coded per second, encode and decode together, on one CPU core: measured by
# scripts/bench_codecs.py on (16, 128, 128) activations (subspace+fp16/bf16 estimated). Dense
# codecs are not the cheapest: zstd over 2–4× more bytes costs more than quantising.
DEFAULT_SPEEDS: Mapping[str, float] = {
    "fp32": 200e6,
    "fp16": 320e6,
    "bf16": 340e6,
    "int8": 320e6,
    "int4": 300e6,
    "subspace": 320e6,
    "subspace+fp16": 320e6,
    "subspace+bf16": 320e6,
    "subspace+int8": 380e6,
    "subspace+int4": 300e6,
}


def hop_seconds(codec: Codec, shape: tuple[int, ...], *, bandwidth: float, speeds: Mapping[str, float] = DEFAULT_SPEEDS) -> float:
    """Estimated encode + transfer + decode time of one tensor over a link of ``bandwidth`` bytes/s."""
    fp32_bytes = 4 * math.prod(shape)
    return fp32_bytes / codec.estimated_ratio(shape) / bandwidth + fp32_bytes / speeds[codec.name]


def choose_codec(
    codecs: Sequence[Codec], shape: tuple[int, ...], *, bandwidth: float, budget_s: float, speeds: Mapping[str, float] = DEFAULT_SPEEDS
) -> Codec:
    """The first of ``codecs`` (listed most faithful first) whose hop fits ``budget_s``; if none does, the fastest.

    ``bandwidth`` is the link's measured bytes per second (e.g. an EMA over recent frames).
    """
    if not codecs:
        raise ValueError("choose_codec needs at least one codec")
    if not bandwidth > 0 or not budget_s > 0:
        raise ValueError(f"bandwidth and budget_s must be positive, got {bandwidth}, {budget_s}")
    times = [hop_seconds(c, shape, bandwidth=bandwidth, speeds=speeds) for c in codecs]
    fitting = [c for c, t in zip(codecs, times) if t <= budget_s]
    return fitting[0] if fitting else codecs[times.index(min(times))]
