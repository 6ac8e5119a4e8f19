"""Deterministic fault injection for tests and the WAN lab: SIGKILL named peers at given steps or times.

A ``FaultSchedule`` ("kill P at its step N" or "at T seconds") parses from a short spec, prints back to it and
can be drawn from a seed, so a failure run repeats exactly; a peer carries out its own step faults
(``kill_this_peer``), a ``FaultInjector`` timed ones from outside. More: docs/architecture.md, fault injection.

    >>> FaultInjector(FaultSchedule.parse("stage2-a@step=40,trainer1@t=30s"), pids).poll({"stage2-a": 41})  # ['stage2-a']
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

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


def random_failures(peers: Iterable[str], rate_per_hour: float, duration_s: float, seed: int) -> FaultSchedule:
    """A reproducible random schedule: each peer fails at most once, at an exponential time.

    ``rate_per_hour`` is each peer's failure rate (0.1 ≈ 10% of peers fail per hour); a peer whose
    time falls beyond ``duration_s`` survives. Each peer has its own seeded stream, so the same
    (seed, peer) gives the same time whatever the other peers are.

        >>> str(random_failures(["s1-a", "s1-b", "s2-a"], rate_per_hour=2.0, duration_s=600, seed=0))
        's2-a@t=86.014s,s1-b@t=488.224s'
    """
    if not (math.isfinite(rate_per_hour) and rate_per_hour >= 0):
        raise ValueError(f"rate_per_hour must be finite and non-negative, got {rate_per_hour}")
    if not duration_s >= 0:
        raise ValueError(f"duration_s must be non-negative, got {duration_s}")
    times = []
    for peer in sorted(set(peers)):
        rng = random.Random(f"{seed}/{peer}")  # str seeds hash with sha512: stable across runs and platforms
        at_s = rng.expovariate(rate_per_hour / 3600) if rate_per_hour > 0 else math.inf
        if at_s < duration_s:
            times.append((round(at_s, 3), peer))  # ms: a readable, exact spec
    return FaultSchedule(tuple(FaultEvent(peer=peer, at_s=at_s) for at_s, peer in sorted(times)))


class FaultInjector:
    """Kills each scheduled peer's process with SIGKILL once its first event is due, exactly once.

    Time is measured from the injector's creation. A peer's later events are dropped once it has been
    killed: its pid may since have been reused by an unrelated process. A process that already exited
    is not killed and not reported.
    """

    def __init__(
        self,
        schedule: FaultSchedule,
        processes: Mapping[str, subprocess.Popen[Any] | int],
        clock: Callable[[], float] = time.monotonic,
        *,
        kill: Callable[[int, int], None] = os.kill,
    ) -> None:
        unknown = sorted(set(schedule.peers) - set(processes))
        if unknown:
            raise ValueError(f"the fault schedule names peers with no process: {unknown} (known: {sorted(processes)})")
        self.schedule, self.processes, self.clock, self.kill = schedule, processes, clock, kill
        self.start = clock()
        self.fired: set[str] = set()  # peers whose fault has come, killed or found already gone

    def poll(self, step_by_peer: Mapping[str, int] | None = None) -> list[str]:
        """Kill the peers whose event is due now; returns their names (each name at most once, ever)."""
        steps, elapsed = step_by_peer or {}, self.clock() - self.start
        killed = []
        for peer in self.schedule.peers:
            if peer in self.fired or not self.schedule.due(peer, steps.get(peer), elapsed):
                continue
            self.fired.add(peer)
            process = self.processes[peer]
            if isinstance(process, subprocess.Popen) and process.poll() is not None:
                continue
            try:
                self.kill(process if isinstance(process, int) else process.pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed.append(peer)
        return killed


def kill_this_peer() -> None:
    """SIGKILL this process, and its whole process group when it leads one (``spawn_peer`` starts peers so): the
    DHT and libp2p daemons die with it, as in a power cut, leaving records that only expire."""
    if os.getpgrp() == os.getpid():
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


async def wait_for_step(step: int, current: Callable[[], int | None], *, poll_s: float = 0.01) -> int:
    """Return once ``current()`` (the peer's inner step; None: not started) reaches ``step``: the step it read.

    Polled, not hooked into the step itself, so the peer's loops stay free of test code; at 10 ms a
    poll sees every step of a CPU-sized model.
    """
    while (now := current()) is None or now < step:
        await asyncio.sleep(poll_s)
    return now
