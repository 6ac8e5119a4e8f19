"""A trainer's start: it waits for a server of every middle stage (``wait_for_stages``), then for the replicas of
stage 0 it was told to start with (``wait_for_replicas``). In a short run the other trainer may train and leave
within one announce period: a trainer that saw the last stage one period late, then waited for a replica listed only
between two of its looks, waited out the whole timeout (``scripts/gpu_check.py --cpu``'s swarm step, 3 runs in 6)."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from typing import Any

import pytest

from swarm.node.lifecycle import wait_for_replicas
from swarm.node.roles.trainer import wait_for_stages
from swarm.pipeline.routing import Router


@pytest.mark.timeout(30)
def test_a_waiting_trainer_reads_the_stages_at_each_look_not_once_per_announce_period() -> None:
    router = Router(2, random.Random(0))
    router.update(1, ["server-1"])
    looks = 0

    async def refresh() -> None:  # the DHT lists stage 2's server from the third look on
        nonlocal looks
        looks += 1
        if looks == 3:
            router.update(2, ["server-2"])

    started = time.monotonic()
    asyncio.run(wait_for_stages(router, 2, timeout_s=60.0, refresh=refresh))
    assert looks == 3 and time.monotonic() - started < 5.0


@pytest.mark.timeout(30)
def test_a_trainer_waiting_for_a_stage_logs_what_its_dht_node_reaches(caplog: pytest.LogCaptureFixture) -> None:
    router = Router(2, random.Random(0))
    router.update(1, ["server-1"])  # stage 2 has nobody
    probes: list[float] = []

    async def health() -> str:
        probes.append(time.monotonic())
        return "its DHT node knows 3 peers and skips 1 that missed a call"

    with caplog.at_level(logging.WARNING, logger="swarm.node.roles.trainer"):
        asyncio.run(wait_for_stages(router, 2, timeout_s=1.6, health=health, health_every_s=0.5))
    assert len(probes) >= 2
    assert re.search(r"still waiting for servers of stages \[2\] after \d+s: its DHT node knows 3 peers", caplog.text)
    assert "no server for stages [2] after 2s: training skips them" in caplog.text


class Listings:
    """A membership whose stage-0 replicas are, look by look, the given sets (the last one from then on)."""

    def __init__(self, *looks: set[str]) -> None:
        self.looks, self.count = list(looks), 0

    async def replicas(self, stage: int) -> dict[str, Any]:
        self.count += 1
        return dict.fromkeys(self.looks[min(self.count, len(self.looks)) - 1])


@pytest.mark.timeout(30)
def test_every_replica_listed_at_any_look_counts_towards_the_start(caplog: pytest.LogCaptureFixture) -> None:
    # the other trainer is listed at the second look only: it trained and left before the third
    membership = Listings({"me"}, {"me", "other"}, {"me"})
    started = time.monotonic()
    asyncio.run(wait_for_replicas(membership, 2, timeout_s=60.0))  # type: ignore[arg-type]
    assert membership.count == 2 and time.monotonic() - started < 5.0
    alone = Listings({"me"})  # the timeout and its warning: tests/test_full_peer.py
    with caplog.at_level(logging.INFO, logger="swarm.node.lifecycle"):
        asyncio.run(wait_for_replicas(alone, 2, timeout_s=0.6))  # type: ignore[arg-type]
    assert "waiting for 2 replicas of stage 0 (trainers and full peers) to start together: 1 seen" in caplog.text
