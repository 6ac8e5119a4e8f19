"""The trainer's microbatch window (swarm/pipeline/trainer.py): a stream of microbatches in flight across inner steps,
sized like a transport window, with bounded and reported staleness, and outer installs on an inner-step boundary.

The stage servers are real ``StageServer``s called directly (no network: ``swarmtest.fakes.DirectStages``); latency is an ``asyncio.sleep`` per call
and a held backward is a condition the test sets, so nothing waits on wall-clock luck."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
import torch

from swarm.config import SwarmConfig, TrainerOptions
from swarm.model.stages import EDGE_STAGE
from swarm.outer.replica import ReplicaSync, snapshot_weights
from swarm.outer.state import StageState
from swarm.pipeline.protocol import Backward, Forward
from swarm.pipeline.routing import Peer
from swarm.pipeline.server import StageServer
from swarm.pipeline.trainer import Trainer
from swarm.pipeline.window import Window
from swarmtest.configs import BATCH, SEQ, tiny_config
from swarmtest.fakes import DirectStages

Batch = tuple[torch.Tensor, torch.Tensor]


def config(*, steps: int = 40, microbatches_per_step: int = 1) -> SwarmConfig:
    return tiny_config(stages=1, steps=steps, train={"inner_batch": microbatches_per_step * BATCH})


def batches(seed: int = 0) -> Iterator[Batch]:
    g = torch.Generator().manual_seed(seed)
    while True:
        x = torch.randint(0, 256, (BATCH, SEQ + 1), generator=g)
        yield x[:, :-1], x[:, 1:]


def run(trainer: Trainer, stage: DirectStages, scenario: Awaitable[Any]) -> Any:
    try:
        return asyncio.run(scenario)
    finally:
        trainer.shutdown()
        stage.shutdown()


def assert_accounted(trainer: Trainer) -> None:
    """Every microbatch started ended as completed, failed or cancelled (none in flight after ``train``)."""
    c = trainer.counters
    assert c["started"] == c["completed"] + c["failed"] + c["cancelled"] and trainer.status().queue == 0
    assert c["stale_dropped"] + c["round_dropped"] <= c["completed"]


async def until(what: str, check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(0.002)


# the window's size, on a simulated pipeline (exact times, no event loop)


def simulated_window(*, latency_s: float, service_s: float, cap: int, landings: int = 200) -> Window:
    """A ``Window`` driving a pipeline of a wire of ``latency_s`` each way around one FIFO server taking ``service_s``
    per microbatch; starts as many as the window allows at each landing."""
    window, now, server_free = Window(cap), 0.0, 0.0
    flying: list[tuple[float, int, float]] = []  # (lands at, delivered at start, started at)

    def start() -> None:
        nonlocal server_free
        server_free = max(now + latency_s / 2, server_free) + service_s
        flying.append((server_free + latency_s / 2, window.delivered, now))

    for _ in range(landings):
        while len(flying) < window.size:
            start()
        flying.sort()
        lands, delivered, started = flying.pop(0)
        now = lands
        window.land(delivered, started, now=now)
    return window


def test_the_window_fills_a_long_wire_up_to_its_bandwidth_delay_product() -> None:
    # 100 ms round trip, 10 ms of compute: 11 microbatches keep the server busy, one more waits at it
    window = simulated_window(latency_s=0.100, service_s=0.010, cap=32)
    assert window.round_trip_s == pytest.approx(0.110)
    assert window.microbatches_per_s == pytest.approx(100.0, rel=0.1)
    assert 11 <= window.size <= 13
    assert simulated_window(latency_s=0.100, service_s=0.010, cap=4).size == 4  # the cap holds


def test_a_busy_server_with_no_latency_keeps_the_window_at_two() -> None:
    # one microbatch computing, the next waiting: more would only queue
    assert simulated_window(latency_s=0.0, service_s=0.010, cap=32).size == 2


def test_the_window_starts_at_one_and_an_unmeasured_cap_of_one_stays_one() -> None:
    assert Window(cap=8).size == 1
    assert simulated_window(latency_s=0.1, service_s=0.01, cap=1).size == 1


# the trainer's stream


def test_slow_hops_keep_more_than_an_inner_step_in_flight_with_bounded_staleness() -> None:
    cfg = config(steps=24)  # one microbatch per inner step
    stage = DirectStages.of(cfg, {"s1": 1}, latency_s=0.05)  # the wire, not compute, sets the round trip
    trainer = Trainer(cfg, stage, stage.router, options=TrainerOptions(in_flight=4, max_staleness=3, log_every=4))
    logged: list[dict] = []
    record = run(trainer, stage, trainer.train(batches(), steps=24, on_log=logged.append))
    assert stage.most_open == 4  # four inner steps' microbatches at once: the window spans step boundaries
    assert max(r["window"] for r in logged) == 4 and record["round_trip_s"] > 2 * 0.05  # a forward and a backward
    assert max(r["staleness_max"] for r in logged) == 3  # in order, a microbatch lands three steps after its start
    assert 0 < record["staleness_mean"] <= 3
    assert record["stale_dropped"] == record["round_dropped"] == 0
    assert record["step"] == trainer.inner_steps == 24 and stage.server.inner_steps == 24
    assert_accounted(trainer)
    assert record["completed"] == 24 and record["tokens"] == 24 * BATCH * SEQ  # none started past the last step


def test_max_staleness_bounds_the_window_in_inner_steps() -> None:
    cfg = config(steps=12, microbatches_per_step=2)
    stage = DirectStages.of(cfg, {"s1": 1}, latency_s=0.02)
    trainer = Trainer(cfg, stage, stage.router, options=TrainerOptions(in_flight=8, max_staleness=1))
    record = run(trainer, stage, trainer.train(batches(), steps=12))
    # the current step's two microbatches and the next step's two: no more, whatever the window would take
    assert stage.most_open == 4 and record["staleness_max"] <= 1
    assert_accounted(trainer)


class StepWatch(DirectStages):
    """``DirectStages`` into one ``StageServer`` of stage 1, noting, at each training forward, the trainer's inner step for every microbatch then between its
    forward and its backward: the steps whose microbatches share the pipeline."""

    def __init__(self, cfg: SwarmConfig, trainer_steps: Callable[[], int], *, latency_s: float) -> None:
        super().__init__({"s1": StageServer(cfg, 1)}, latency_s=latency_s)
        self.trainer_steps = trainer_steps
        self.started_in: dict[str, int] = {}  # open microbatch -> the trainer's inner step when its forward came
        self.steps_together: list[set[int]] = []  # at each forward: the steps the open microbatches started in

    async def forward(self, peer: Peer, request: Forward, *, timeout: float) -> bytes:
        if request.train:
            self.started_in[request.mb] = self.trainer_steps()
            self.steps_together.append(set(self.started_in.values()))
        return await super().forward(peer, request, timeout=timeout)

    async def backward(self, peer: Peer, request: Backward, *, timeout: float) -> bytes:
        reply = await super().backward(peer, request, timeout=timeout)
        del self.started_in[request.mb]
        return reply


def test_a_window_within_an_inner_step_holds_its_microbatches_and_never_starts_the_next_steps() -> None:
    """``max_staleness=0`` (the default) with four microbatches per inner step: the window fills with the step's four
    (nothing holds it to one microbatch per step), and a microbatch of the next step starts only once the step is
    taken, so none lands stale and none is dropped."""
    cfg = config(steps=8, microbatches_per_step=4)
    trainer: Trainer
    stage = StepWatch(cfg, lambda: trainer.inner_steps, latency_s=0.05)  # the wire sets the round trip
    trainer = Trainer(cfg, stage, stage.router, options=TrainerOptions(in_flight=4, log_every=1))
    logged: list[dict] = []
    record = run(trainer, stage, trainer.train(batches(), steps=8, on_log=logged.append))
    assert stage.most_open == 4 and max(r["window"] for r in logged) == 4  # a whole step's microbatches at once
    assert all(len(steps) == 1 for steps in stage.steps_together)  # never two inner steps' microbatches in flight
    assert max(r["staleness_max"] for r in logged) == 0 and record["stale_dropped"] == 0
    assert record["step"] == trainer.inner_steps == 8 and stage.server.inner_steps == 8
    assert record["completed"] == 8 * 4 and record["tokens"] == 8 * 4 * BATCH * SEQ  # none started past the last step
    assert_accounted(trainer)


def test_a_window_of_one_is_the_synchronous_loop() -> None:
    """``in_flight=1`` trains exactly as one microbatch after the other did: same losses, same weights."""
    cfg = config(steps=6, microbatches_per_step=2)

    def trained(windowed: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
        stage = DirectStages.of(cfg, {"s1": 1})
        trainer = Trainer(cfg, stage, stage.router, options=TrainerOptions(in_flight=1, log_every=1))
        losses: list[float] = []

        async def scenario() -> None:
            if windowed:
                await trainer.train(batches(), steps=6, on_log=lambda r: losses.append(r["train_loss"]))
                return
            data = batches()
            while trainer.inner_steps < 6:
                step_losses = [await trainer.train_microbatch(*next(data)) for _ in range(2)]
                losses.append(sum(step_losses) / 2)

        run(trainer, stage, scenario())
        assert stage.most_open == 1
        weights = {f"edge.{n}": p.detach().clone() for n, p in trainer.module.named_parameters()}
        return losses, weights | {f"s1.{n}": p.detach().clone() for n, p in stage.server.module.named_parameters()}

    (losses, weights), (sync_losses, sync_weights) = trained(windowed=True), trained(windowed=False)
    assert losses == sync_losses and len(losses) == 6
    assert weights.keys() == sync_weights.keys()
    assert all(torch.equal(weights[name], sync_weights[name]) for name in weights)


def test_a_microbatch_overtaken_past_max_staleness_is_dropped_and_counted() -> None:
    cfg = config(steps=6)
    trainer: Trainer

    backwards: list[str] = []  # the microbatches whose backwards came, in order (a probe's forward takes an id too)

    async def hold_second(request: Backward) -> None:  # the second microbatch starts at step 1; it lands at step 3
        backwards.extend([] if request.mb in backwards else [request.mb])
        if backwards.index(request.mb) == 1:
            await until("inner step 3", lambda: trainer.inner_steps >= 3)

    stage = DirectStages.of(cfg, {"s1": 1}, hold=hold_second)
    trainer = Trainer(cfg, stage, stage.router, options=TrainerOptions(in_flight=4, max_staleness=1, log_every=1))
    logged: list[dict] = []
    record = run(trainer, stage, trainer.train(batches(), steps=6, on_log=logged.append))
    assert record["stale_dropped"] == 1 and record["round_dropped"] == 0
    assert max(r["staleness_max"] or 0 for r in logged) == 2  # reported, though its gradients were dropped
    assert trainer.inner_steps == 6 and record["completed"] == 7  # another microbatch took its place
    assert record["tokens"] == 6 * BATCH * SEQ  # the dropped one's tokens trained nothing on stage 0
    assert_accounted(trainer)


@pytest.mark.parametrize("change", ["moved", "replaced"])
def test_a_download_drops_the_gradients_of_microbatches_begun_on_the_old_weights_and_an_install_keeps_them(
    change: str,
) -> None:
    """A download (``ReplicaSync.adopt``) falls on an inner-step boundary: the gradient held for the next step and
    every microbatch in flight are dropped; an outer round's install only moves the weights, and keeps them all.
    Training goes on after either."""
    cfg = config(steps=6, microbatches_per_step=2)
    frozen, blocked = asyncio.Event(), set()

    async def hold_from_mb3(request: Backward) -> None:  # mb0, mb1 make step 1; mb2 is held for step 2
        if int(request.mb.removeprefix("mb")) >= 3 and not frozen.is_set():
            blocked.add(request.mb)
            await frozen.wait()

    stage = DirectStages.of(cfg, {"s1": 1}, hold=hold_from_mb3)
    trainer = Trainer(cfg, stage, stage.router, options=TrainerOptions(in_flight=4, max_staleness=3))
    sync = ReplicaSync(cfg, EDGE_STAGE, trainer, net=None, board=None, replicas=None, fetch=None)  # type: ignore[arg-type]  # no network: what the test calls needs none

    async def scenario() -> tuple[int, int, dict]:
        training = asyncio.create_task(trainer.train(batches(), steps=6))
        # the whole window stuck at its backward: nothing lands or starts while the round installs
        await until(
            "the window stuck at its backward",
            lambda: len(blocked) >= 2 and len(blocked) == trainer.status().queue == trainer.window.size,
        )
        held = trainer.inner.samples // BATCH
        weights = await snapshot_weights(trainer)
        if change == "replaced":
            await sync.adopt(StageState(stage=EDGE_STAGE, round=1, schedule_step=1, params=weights, optimizer=None))
            assert trainer.inner.samples == 0 and all(p.grad is None for p in trainer.module.parameters())
        else:  # a move as the install's swap makes: every weight changes, the held gradient stays
            moved = {name: w + 0.01 for name, w in weights.items()}
            await trainer.exclusive(lambda: trainer.module.load_state_dict(moved, strict=False), change="moved")
            assert trainer.inner.samples == held * BATCH
        in_flight = len(blocked)
        frozen.set()
        return held, in_flight, await training

    held, in_flight, record = run(trainer, stage, scenario())
    assert held == 1 and in_flight >= 2
    assert record["round_dropped"] == (held + in_flight if change == "replaced" else 0)
    assert record["stale_dropped"] == 0 and trainer.inner_steps == 6
    assert sync.round == (1 if change == "replaced" else 0)  # the download adopted round 1; a move is no round
    # the kept ones need no recompute: 6 steps of 2 microbatches, plus each dropped one again
    assert record["completed"] == 6 * 2 + record["round_dropped"], record
    assert record["tokens"] == 6 * 2 * BATCH * SEQ  # the dropped ones' tokens, the held one's too, trained nothing
    assert_accounted(trainer)


def test_max_staleness_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match="max_staleness"):
        TrainerOptions(max_staleness=-1)


def test_a_server_refusing_this_trainers_gradient_is_not_banned_for_it() -> None:
    """An invalid reply says the trainer sent something the server would not take (its screen refused the gradient):
    the trainer's fault. The server keeps its place in the routing; the microbatch goes on or fails, counted."""
    from swarm.pipeline.protocol import RemoteError, RequestError

    cfg = config(steps=6)
    refusals = [3]  # the first three backwards are refused

    async def refuse(request: Backward) -> None:
        if refusals[0] > 0:
            refusals[0] -= 1
            raise RemoteError(RequestError.INVALID, "microbatch gradient refused: gradient norm 1e9 is over 1000×")

    stage = DirectStages.of(cfg, {"s1": 1}, hold=refuse)
    trainer = Trainer(cfg, stage, stage.router, options=TrainerOptions(in_flight=1, max_attempts=3))
    record = run(trainer, stage, trainer.train(batches(), steps=6))
    assert record["hop_refused_invalid"] == 3 and record["step"] == 6
    assert stage.router.balancers[1].live_peers() == ["s1"]  # never banned: with a ban the stage would have none
    assert_accounted(trainer)
