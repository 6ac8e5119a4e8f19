"""A stage server's busy fraction: compute time over wall time, since its first request and over a recent window.

A fake clock that only the computes (and the test, between requests) move: the fractions are exact, no sleeps.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from pydantic.v1 import ValidationError

from compress.codecs import get_codec
from swarm.dht.metrics import Meter
from swarm.pipeline.metering import BusyTime
from swarm.pipeline.protocol import Backward, Forward
from swarm.pipeline.server import StageServer
from swarmtest.clock import FakeClock
from swarmtest.configs import RPC_BATCH, RPC_SEQ, RPC_WIDTH, rpc_config


def test_busy_time_counts_intervals_since_the_first_and_over_the_window() -> None:
    clock = FakeClock(100.0)
    busy = BusyTime(window_s=10.0, clock=clock)
    assert busy.fractions() == (None, None)  # nothing served yet: no fraction, not 0
    clock.advance(50.0)  # waiting for the first request is not idle time
    busy.add(clock.now, clock.now + 2.0)
    clock.advance(8.0)
    assert busy.fractions() == pytest.approx((0.25, 0.25))
    busy.add(clock.now, clock.now + 1.0)  # 8..9
    clock.advance(12.0)  # t = 20 since the first: the window is 10..20, after both intervals
    assert busy.fractions() == pytest.approx((0.0, 3.0 / 20.0))
    busy.add(clock.now - 1.0, clock.now)  # 19..20: an interval is added when it ends
    assert busy.fractions() == pytest.approx((0.1, 4.0 / 20.0))
    clock.advance(9.5)  # the window is 19.5..29.5: half of the last interval is still in it
    assert busy.fractions() == pytest.approx((0.05, 4.0 / 29.5))


def test_busy_time_refuses_a_window_that_is_not_positive() -> None:
    with pytest.raises(ValueError, match="window_s must be positive"):
        BusyTime(window_s=0.0)


def test_a_stage_servers_busy_fraction_is_its_compute_time_over_wall_time() -> None:
    """Forward 0.2 s, backward 0.1 s, then 0.3 s idle, five times: busy half the time; then a long pause."""
    clock, codec = FakeClock(100.0), get_codec("fp32")
    server = StageServer(rpc_config(), 1, clock=clock, busy_window_s=1.2)
    forward, backward = server._compute_forward, server._compute_backward

    def timed(compute, seconds: float):
        def run(*args: torch.Tensor) -> torch.Tensor:
            clock.advance(seconds)  # on the compute thread, between the server's two clock readings
            return compute(*args)

        return run

    server._compute_forward, server._compute_backward = timed(forward, 0.2), timed(backward, 0.1)

    async def serve(mb: str) -> None:
        x = codec.encode(torch.randn(RPC_BATCH, RPC_SEQ, RPC_WIDTH))
        await server.forward("p", Forward(mb=mb, stage=1, prev_stage=0, x=x))
        await server.backward(
            "p", Backward(mb=mb, stage=1, grad=codec.encode(torch.randn(RPC_BATCH, RPC_SEQ, RPC_WIDTH)))
        )

    async def scenario() -> None:
        assert server.info()["busy_fraction"] is None  # nothing served yet
        clock.advance(30.0)  # startup: not counted
        for k in range(5):
            await serve(f"m{k}")
            clock.advance(0.3)
        info = server.info()
        assert info["busy_fraction"] == pytest.approx(0.5) and info["busy_fraction_total"] == pytest.approx(0.5)
        clock.advance(1.2)  # a whole window idle: the recent fraction drops to 0, the total to 1.5 / 4.2
        recent, total = server.busy.fractions()
        assert recent == pytest.approx(0.0) and total == pytest.approx(1.5 / 4.2)
        await serve("m5")
        assert server.busy.fractions() == pytest.approx((0.3 / 1.2, 1.8 / 4.5))
        await server.exclusive(lambda: clock.advance(5.0))  # the outer step's work is not a request
        assert server.busy.fractions() == pytest.approx((0.0, 1.8 / 9.5))
        server.shutdown()

    asyncio.run(scenario())


def test_the_metrics_record_carries_the_busy_fraction_and_refuses_one_out_of_range() -> None:
    server = StageServer(rpc_config(), 1)
    meter = Meter(role="stage", stage=1, state="serving")
    assert meter.sample(server.status(queue=0), tokens=0).busy_fraction is None  # trainers, and before any request
    assert meter.sample(server.status(queue=0), tokens=0, busy_fraction=0.75).busy_fraction == 0.75
    with pytest.raises(ValidationError):
        meter.sample(server.status(queue=0), tokens=0, busy_fraction=1.5)
    server.shutdown()
