"""Where a stage server's time per microbatch goes: decode, wait for the compute thread, copy to the device, compute,
encode; the medians of the recent requests of each kind go into its progress records (``StageServer.info``).

    >>> times = RequestTimes(); x = timed_copy(x, device, times, clock); split.add("forward", times)
    >>> split.summary()  # {"forward": {"decode_s": …, "wait_s": …, "copy_s": …, "compute_s": …, "encode_s": …}, …}
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

SPLIT_WINDOW = 64  # requests of each kind the medians are over: a few inner steps, the warm-up soon left behind


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` where it runs asynchronously (CUDA), so that a clock read next counts it;
    nothing on the CPU, whose ops are done when they return (its timing stays free)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class RequestTimes:
    """One request's seconds, by part; the compute thread fills ``copy_s``, ``compute_s`` and ``recomputed``."""

    decode_s: float = 0.0  # the frame decoded onto the device (a thread of its own: only its coded bytes cross)
    wait_s: float = 0.0  # queued for the compute thread, behind other requests and the outer step's work
    copy_s: float = 0.0  # host → device moves the compute still made (none once a frame is decoded on the device)
    compute_s: float = 0.0  # the forward or backward on the compute thread, its copies excluded
    encode_s: float = 0.0  # the reply encoded (its device → host copy included, where the codec makes it)
    recomputed: bool = False  # a backward's: its forward was recomputed (no kept graph)


SPLIT_FIELDS = tuple(f.name for f in fields(RequestTimes) if f.name.endswith("_s"))


def timed_copy(
    tensor: torch.Tensor, device: torch.device, times: RequestTimes, clock: Callable[[], float]
) -> torch.Tensor:
    """``tensor`` on ``device``, its copy's time added to ``times.copy_s`` (synchronised where the copy is async); one
    already there (a frame decoded onto the device) is returned as it is, with no wait for the device."""
    started = clock()
    moved = tensor.to(device)
    if moved is tensor:
        return tensor
    synchronize(device)
    times.copy_s += clock() - started
    return moved


class TimeSplit:
    """Medians of the last ``window`` requests' times, by kind ("forward", "backward"); ``add`` and ``summary`` run on
    the event loop. Medians, not means: a compile, a first allocation or a swapped-out page stays one request's."""

    def __init__(self, *, window: int = SPLIT_WINDOW) -> None:
        self.window = window
        self._recent: dict[str, deque[RequestTimes]] = {}

    def add(self, kind: str, times: RequestTimes) -> None:
        self._recent.setdefault(kind, deque(maxlen=self.window)).append(times)

    def summary(self) -> dict[str, dict[str, float]]:
        """By kind: each part's median seconds, ``requests`` (how many the medians are over), and for backwards
        ``recomputed`` (the fraction of them that recomputed their forward)."""
        split: dict[str, dict[str, float]] = {}
        for kind, recent in self._recent.items():
            split[kind] = {name: statistics.median(getattr(t, name) for t in recent) for name in SPLIT_FIELDS}
            split[kind]["requests"] = len(recent)
            if kind == "backward":
                split[kind]["recomputed"] = sum(t.recomputed for t in recent) / len(recent)
        return split
