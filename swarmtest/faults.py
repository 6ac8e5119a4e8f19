"""Fault injection: faults keyed by (peer, step), as torchft keys them by (rank, step), which each named peer carries
out itself at its own inner step (the hook in ``swarm/node/node.py``), in a swarm of processes or a ``Node`` in this
process; timed faults from outside (``FaultInjector``, SIGKILL by pid); and seeded random schedules
(``random_failures``). The schedule itself is ``swarm.faults.FaultSchedule``, what ``PeerConfig.faults`` holds.

    swarm.spawn("stage2-a", PeerConfig(role="stage", stage=2, faults=kill_at({"stage2-a": 10})))  # give every peer the same
    BackgroundNode(PeerConfig(role="trainer", name="doomed", faults=kill_at({"doomed": 4})), ...)
    FaultInjector(FaultSchedule.parse("stage2-a@step=40,trainer1@t=30s"), pids).poll({"stage2-a": 41})  # ['stage2-a']

In-memory networks take faults by peer: ``Hub.dead`` / ``cut`` / ``slow``, ``InProcessNetwork.dead`` (swarmtest.fakes).
"""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from swarm.faults import FaultEvent, FaultSchedule

__all__ = ["FaultEvent", "FaultInjector", "FaultSchedule", "kill_at", "random_failures"]


def kill_at(steps: Mapping[str, int]) -> FaultSchedule:
    """Each peer named in ``steps`` dies once its inner step reaches its number (every other peer ignores it)."""
    return FaultSchedule([FaultEvent(peer=peer, step=step) for peer, step in steps.items()])


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
