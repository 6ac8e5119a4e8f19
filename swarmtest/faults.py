"""Faults keyed by (peer, step), as torchft keys them by (rank, step): each named peer kills itself at its own inner
step (``swarm.faults`` carries them out inside the peer), in a swarm of processes or a ``Node`` in this process.

    swarm.spawn("stage2-a", PeerConfig(role="stage", stage=2, faults=kill_at({"stage2-a": 10})))  # give every peer the same
    BackgroundNode(PeerConfig(role="trainer", name="doomed", faults=kill_at({"doomed": 4})), ...)

In-memory networks take faults by peer: ``Hub.dead`` / ``cut`` / ``slow``, ``InProcessNetwork.dead`` (swarmtest.fakes).
"""

from __future__ import annotations

from collections.abc import Mapping

from swarm.faults import FaultEvent, FaultSchedule


def kill_at(steps: Mapping[str, int]) -> FaultSchedule:
    """Each peer named in ``steps`` dies once its inner step reaches its number (every other peer ignores it)."""
    return FaultSchedule([FaultEvent(peer=peer, step=step) for peer, step in steps.items()])
