"""The throughput model (``swarmloco plan``, issue 43): per-link bytes, per-stage compute, the trainer's window, and
the tokens per second they allow one trainer, with what limits it.

    >>> from swarm.plan import predict, Swarm
    >>> predict(swarm).tokens_per_s, predict(swarm).bottleneck

``model`` is the arithmetic (no torch), ``shapes`` reads a swarm config into it (frames from the real codecs, compute
from a device's one-process rate), ``measure`` times the real pipeline in this process.
"""

from swarm.plan.model import (
    Compute,
    Frames,
    Link,
    Network,
    Prediction,
    Resource,
    Swarm,
    fix,
    mbit,
    parse_rate,
    predict,
)

__all__ = [
    "Compute",
    "Frames",
    "Link",
    "Network",
    "Prediction",
    "Resource",
    "Swarm",
    "fix",
    "mbit",
    "parse_rate",
    "predict",
]
