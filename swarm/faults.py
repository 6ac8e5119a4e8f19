"""Fault schedules, as data: what ``swarmloco run --faults`` (``PeerConfig.faults``) holds. A ``FaultSchedule`` ("kill
P at its step N" or "at T seconds") parses from a short spec and prints back to it, so a failure run repeats exactly.

Only the schedule lives here. A peer carries out its own step faults through a hook of a few lines in its ``Node``
(``swarm/node/node.py``: at its inner step N it dies); the rest of fault injection is the test harness's
(``swarmtest/faults.py``: ``FaultInjector`` kills timed faults from outside, ``random_failures`` draws a schedule
from a seed, ``kill_at`` builds one). More: docs/architecture.md, fault injection.

    >>> str(FaultSchedule.parse("stage2-a@step=40, trainer1@t=0.5m"))
    'stage2-a@step=40,trainer1@t=30.0s'
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_PEER_NAME = re.compile(r"[A-Za-z0-9_.:-]+")
_EVENT = re.compile(
    r"(?P<peer>[^@]+)@(?:step=(?P<step>\d+)|t=(?P<seconds>(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?)(?P<unit>[smh]?))"
)
_UNIT_S = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}
SPEC_FORMAT = "PEER@step=N or PEER@t=SECONDS[s|m|h], comma-separated"


@dataclass(frozen=True, kw_only=True)
class FaultEvent:
    """Kill ``peer`` once its step reaches ``step``, or once ``at_s`` seconds have elapsed (exactly one)."""

    peer: str
    step: int | None = None
    at_s: float | None = None

    def __post_init__(self) -> None:
        if not _PEER_NAME.fullmatch(self.peer):
            raise ValueError(f"fault peer name {self.peer!r}: use letters, digits, '_', '.', ':' or '-'")
        if (self.step is None) == (self.at_s is None):
            raise ValueError(f"fault for {self.peer!r}: give exactly one of step or at_s")
        if self.step is not None and self.step < 0:
            raise ValueError(f"fault for {self.peer!r}: step must be non-negative, got {self.step}")
        if self.at_s is not None and not (math.isfinite(self.at_s) and self.at_s >= 0):
            raise ValueError(f"fault for {self.peer!r}: at_s must be finite and non-negative, got {self.at_s}")

    def due(self, step: int | None, elapsed_s: float | None) -> bool:
        """Whether the event has come, given the peer's step and the seconds elapsed (None: unknown)."""
        if self.step is not None:
            return step is not None and step >= self.step
        return elapsed_s is not None and self.at_s is not None and elapsed_s >= self.at_s

    def __str__(self) -> str:
        return f"{self.peer}@step={self.step}" if self.step is not None else f"{self.peer}@t={self.at_s!r}s"


@dataclass(frozen=True)
class FaultSchedule:
    """A fixed list of fault events; ``str(schedule)`` is a spec that ``parse`` reads back."""

    events: tuple[FaultEvent, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "events", tuple(self.events))  # accept any iterable, stay hashable

    @classmethod
    def parse(cls, spec: str) -> FaultSchedule:
        """``"stage2-a@step=40,trainer1@t=30s"`` → two events; an empty spec is an empty schedule."""
        return cls(tuple(_parse_event(item.strip()) for item in spec.split(",")) if spec.strip() else ())

    @property
    def peers(self) -> list[str]:
        return sorted({event.peer for event in self.events})

    def due(self, peer: str, step: int | None = None, elapsed_s: float | None = None) -> bool:
        """Whether any event for ``peer`` has come."""
        return any(event.due(step, elapsed_s) for event in self.events if event.peer == peer)

    def __str__(self) -> str:
        return ",".join(map(str, self.events))


def _parse_event(item: str) -> FaultEvent:
    match = _EVENT.fullmatch(item)
    if match is None:
        raise ValueError(f"bad fault {item!r}: expected {SPEC_FORMAT}")
    peer = match["peer"].strip()
    if match["step"] is not None:
        return FaultEvent(peer=peer, step=int(match["step"]))
    return FaultEvent(peer=peer, at_s=float(match["seconds"]) * _UNIT_S[match["unit"]])
