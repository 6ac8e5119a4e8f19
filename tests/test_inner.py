"""The inner optimizer factory: warmup, cosine decay, parameter groups, schedule offset; no step on a non-finite
gradient norm, and the screen of outsized gradients."""

import asyncio
import logging
import math
import statistics

import pytest
import torch
from hivemind.p2p import PeerID

from optim.config import InnerOptimConfig
from optim.inner import (
    CLIP_MAX_RATIO,
    PROBATION_MICROBATCHES,
    PROBATION_SHARE,
    PROBATION_WEIGHT,
    GradNormScreen,
    Verdict,
    clip_and_step,
    lr_factor,
    make_inner_optimizer,
)
from swarm.model.step import InnerStep
from swarm.pipeline.protocol import Backward, Forward, RequestError
from swarm.pipeline.server import StageServer
from swarmtest.attacks import HONEST_SCALE, INT8, activations
from swarmtest.configs import BATCH, SEQ, tiny_config

CFG = InnerOptimConfig(lr=1e-3, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)


def test_schedule_warms_up_linearly_then_decays_to_the_floor() -> None:
    assert lr_factor(0, CFG) == pytest.approx(0.1) and lr_factor(9, CFG) == pytest.approx(1.0)
    assert lr_factor(60, CFG) == pytest.approx(0.55)  # half way through the cosine
    assert lr_factor(110, CFG) == pytest.approx(0.1) and lr_factor(500, CFG) == pytest.approx(0.1)
    factors = [lr_factor(s, CFG) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(factors, factors[1:]))


def test_gains_get_no_weight_decay_and_steps_follow_the_schedule() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt, sched = make_inner_optimizer(model.parameters(), CFG)
    assert [g["weight_decay"] for g in opt.param_groups] == [CFG.weight_decay, 0.0]
    assert sum(len(g["params"]) for g in opt.param_groups) == 4  # weight | bias + 2 norm params
    model(torch.randn(2, 4)).sum().backward()
    norm = clip_and_step(opt, sched, 1.0)
    assert norm > 0 and all(p.grad is None for p in model.parameters())
    assert sched.get_last_lr()[0] == pytest.approx(1e-3 * lr_factor(1, CFG))


def test_start_step_and_lr_scale_place_a_newcomer_on_the_swarm_schedule() -> None:
    opt, _ = make_inner_optimizer([torch.nn.Parameter(torch.ones(2, 2))], CFG, lr_scale=1.1, start_step=60)
    assert opt.param_groups[0]["lr"] == pytest.approx(1.1e-3 * lr_factor(60, CFG))


def test_a_non_finite_gradient_norm_skips_the_step_and_writes_no_weights(caplog: pytest.LogCaptureFixture) -> None:
    layer = torch.nn.Linear(4, 4)
    inner = InnerStep(layer.parameters(), CFG, inner_batch=2)
    layer(torch.randn(2, 4)).sum().backward()
    assert inner.add(2) and inner.steps == 1 and 0 < inner.grad_norm < math.inf
    stepped, norm = [p.detach().clone() for p in layer.parameters()], inner.grad_norm
    layer.weight.grad = torch.full_like(
        layer.weight, 3.4e38
    )  # finite values whose norm overflows: clipping made NaN of it
    layer.bias.grad = torch.zeros_like(layer.bias)
    assert not inner.add(2), "the step is skipped"
    assert inner.steps == 1 and inner.skipped == 1 and inner.grad_norm == norm  # the last finite norm is kept
    assert all(p.grad is None for p in layer.parameters()), "the poisoned gradients are dropped"
    assert all(torch.equal(p, s) for p, s in zip(layer.parameters(), stepped)) and inner.lr == pytest.approx(
        1e-3 * lr_factor(1, CFG)
    )  # neither the weights nor the schedule moved
    assert "inner step skipped" in caplog.text


def test_a_peer_whose_steps_pass_the_schedule_warns_once(caplog: pytest.LogCaptureFixture) -> None:
    layer = torch.nn.Linear(4, 4)
    inner = InnerStep(layer.parameters(), InnerOptimConfig(lr=1e-3, warmup_steps=1, total_steps=3), inner_batch=1)

    def steps(n: int) -> list[str]:
        caplog.clear()
        for _ in range(n):
            layer(torch.randn(1, 4)).sum().backward()
            assert inner.add(1)
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    assert steps(3) == [], "a run as long as the schedule ends on it: no warning"
    warned = steps(4)  # past the end: once, however long it goes on
    assert warned == [
        "the cosine schedule ended at step 3; lr stays at min_lr_ratio·lr = 0.0001; set [inner] "
        "total_steps to the run's length"
    ]
    assert inner.lr == pytest.approx(1e-4)
    late = InnerStep([torch.nn.Parameter(torch.ones(2, 2))], CFG, start_step=500, inner_batch=1)
    assert late.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)  # a joiner after the end starts on the floor
    assert any("ended at step 110" in r.getMessage() for r in caplog.records), "and says so"


def honest_norms(n: int, *, seed: int = 0, sigma: float = 0.4) -> list[float]:
    """Per-microbatch gradient norms as a stage sees them later in training: lognormal about 0.3, a few ×2.5
    (tests/test_swarm_integration.py's killed-stage run measured at most 2.7× the median after 64 norms)."""
    gen = torch.Generator().manual_seed(seed)
    return [0.3 * math.exp(sigma * float(z)) for z in torch.randn(n, generator=gen)]


def feed(screen: GradNormScreen, norms: list[float], peer: str) -> list[Verdict]:
    verdicts: list[Verdict] = []
    for norm in norms:
        verdict = screen.judge(norm, peer)
        assert verdict.refusal is None, verdict.refusal
        screen.accept(verdict, peer)
        verdicts.append(verdict)
    return verdicts


def test_the_screen_refuses_non_finite_norms_and_those_far_above_the_stages_median() -> None:
    screen = GradNormScreen(window=8, warmup=3)
    assert screen.judge(math.inf, "a").refusal and screen.judge(math.nan, "a").refusal
    first = screen.judge(1e30, "a")  # no reference yet: only finiteness (and no one established to weigh it against)
    assert first.refusal is None and first.weight == 1.0 and not first.clipped
    screen = GradNormScreen(window=8, warmup=3)
    feed(screen, [1.0, 2.0, 3.0], "a")
    assert screen.bounds()[0] == 2.0 and "over 1000× the median 2" in (screen.judge(2001.0, "b").refusal or "")
    assert screen.judge(1999.0, "b").clipped, "below the refusal bound: clipped, no strike"
    assert screen.peers["b"].refused == 1 and screen.peers["b"].accepted == 0
    feed(screen, [2.0] * 5, "a")  # the window is full: the settled bound
    assert "over 100× the median" in (screen.judge(201.0, "b").refusal or "") and not screen.judge(199.0, "b").refusal
    with pytest.raises(ValueError):
        GradNormScreen(window=4, warmup=5)


def test_570x_gradients_from_seven_fresh_identities_move_the_weights_no_more_than_an_honest_microbatch() -> None:
    """The issue's attack: 65 microbatches at ~570× the median from 7 new identities, among an honest trainer's."""
    screen = GradNormScreen()
    honest = honest_norms(400)
    counted = [v.weight * n for v, n in zip(feed(screen, honest[:40], "honest"), honest[:40], strict=True)]
    median = statistics.median(honest[:40])
    outcomes = {"refused": 0, "clipped": 0}
    for i in range(65):
        norm = 570 * median
        verdict = screen.judge(norm, f"sybil{i % 7}")
        if verdict.refusal is not None:  # once the window holds 64 norms: over 100× its median
            outcomes["refused"] += 1
        else:
            outcomes["clipped"] += verdict.clipped
            assert verdict.clipped and verdict.weight * norm <= max(counted), (i, verdict)
            screen.accept(verdict, f"sybil{i % 7}")
        counted += [v.weight * n for v, n in zip(feed(screen, honest[40 + 2 * i : 42 + 2 * i], "honest"), honest)]
    assert outcomes["refused"] > 0 and outcomes["refused"] + outcomes["clipped"] == 65, outcomes
    # each counted at most √(clip ratio) × the median at half weight: below an established honest microbatch's bound
    assert all(s.accepted < PROBATION_MICROBATCHES for peer, s in screen.peers.items() if peer != "honest")
    before = screen.bounds()
    for i in range(500):  # a flood from fresh identities, ten times the window: judged, counted less, never recorded
        verdict = screen.judge(570 * median if i % 2 else 3 * median, f"flood{i}")
        if verdict.refusal is None:
            screen.accept(verdict, f"flood{i}")
    assert screen.bounds() == before and before[0] < 1.5 * median


def test_an_early_honest_spike_is_clipped_not_refused() -> None:
    """Early in training the killed-stage test once measured honest norms 144× and 150× the median of the 13 accepted
    before them: no strike for those (and a norm that large is clipped, at most to CLIP_MAX_RATIO × the median)."""
    screen = GradNormScreen()
    early = honest_norms(13, sigma=1.0)
    feed(screen, early, "trainer")
    for ratio in (144.0, 150.0):
        median = screen.bounds()[0]
        verdict = screen.judge(ratio * median, "trainer")
        assert verdict.refusal is None and verdict.clipped
        assert verdict.counted == pytest.approx(CLIP_MAX_RATIO * median)
        screen.accept(verdict, "trainer")
    assert screen.peers["trainer"].refused == 0
    # and honest drift within the window's spread is counted whole
    steady = GradNormScreen()
    verdicts = feed(steady, honest_norms(300, seed=1), "trainer")
    assert sum(v.clipped for v in verdicts) <= 1


def test_a_new_peer_is_on_probation_for_its_first_microbatches_and_the_table_is_bounded() -> None:
    screen = GradNormScreen(probation=4, max_peers=3)
    assert [v.weight for v in feed(screen, [1.0] * 10, "old")] == [1.0] * 10, "the first peer: no one to weigh against"
    assert [v.weight for v in feed(screen, [1.0] * 6, "new")] == [PROBATION_WEIGHT] * 4 + [1.0] * 2
    median, clip_ratio, _ = screen.bounds()
    newcomer, established = screen.judge(3.0, "newer"), screen.judge(3.0, "new")
    assert newcomer.clipped and newcomer.counted == pytest.approx(math.sqrt(clip_ratio) * median)  # a tighter bound
    assert newcomer.weight == pytest.approx(PROBATION_WEIGHT * newcomer.counted / 3.0)
    assert not established.clipped and established.weight == 1.0
    for peer in ("p1", "p2", "p3"):  # bounded: the longest-silent are forgotten, and start over on probation
        screen.accept(screen.judge(1.0, peer), peer)
    assert list(screen.peers) == ["p1", "p2", "p3"] and screen.on_probation("new") and screen.on_probation("old")
    together = GradNormScreen()  # peers that start together: none on probation
    for _ in range(40):
        for peer in ("a", "b"):
            assert together.judge(1.0, peer).weight == 1.0
            together.accept(together.judge(1.0, peer), peer)


def test_a_flood_of_fresh_identities_weighs_at_most_its_share_together() -> None:
    screen = GradNormScreen()
    feed(screen, honest_norms(64), "honest")
    weights = []
    for i in range(200):  # each microbatch from a new identity, each at the median: only their number is the attack
        verdict = screen.judge(screen.bounds()[0], f"fresh{i}")
        screen.accept(verdict, f"fresh{i}")
        weights.append(verdict.weight)
    assert weights[0] == PROBATION_WEIGHT and weights[-1] <= 1.01 * PROBATION_WEIGHT * PROBATION_SHARE
    # of the last window's weight, the flood's share is about PROBATION_SHARE against an honest peer's 1 per microbatch
    last = weights[-64:]
    assert sum(last) / (sum(last) + 64 * (1 - PROBATION_SHARE)) <= 1.1 * PROBATION_SHARE


def test_a_verdict_scales_the_microbatchs_gradients() -> None:
    grads = [torch.ones(2, 2), None, torch.full((3,), 2.0)]
    Verdict(weight=0.25).scale_(grads)
    assert grads[0] is not None and grads[2] is not None
    assert torch.equal(grads[0], torch.full((2, 2), 0.25)) and torch.equal(grads[2], torch.full((3,), 0.5))


@pytest.mark.timeout(120)
def test_a_stage_server_weighs_and_clips_what_fresh_identities_send() -> None:
    """The same attack against a real ``StageServer`` (tiny model, in-process): what each microbatch adds to the
    stage's accumulated gradients, for an honest trainer's and for 570× ones from 7 identities it never saw."""
    cfg = tiny_config(stages=1, train={"inner_batch": 10_000})  # no inner step: the gradients only accumulate
    server = StageServer(cfg, 1)
    honest = PeerID(b"\x00" * 34)
    sybils = [PeerID(bytes([i + 1]) * 34) for i in range(7)]

    async def added(peer: PeerID, mb: str, scale: float) -> float:
        """The norm of what one microbatch added to the accumulated gradients (0 if refused)."""
        before = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in server.module.parameters()]
        x = INT8.encode(activations(cfg))
        await server.forward(peer, Forward(mb=mb, stage=1, prev_stage=0, x=x))
        grad = INT8.encode(torch.randn(BATCH, SEQ, cfg.model.d_model) * HONEST_SCALE * scale)
        try:
            await server.backward(peer, Backward(mb=mb, stage=1, grad=grad))
        except RequestError:
            return 0.0
        after = [p.grad if p.grad is not None else torch.zeros_like(p) for p in server.module.parameters()]
        return float(torch.linalg.vector_norm(torch.cat([(a - b).flatten() for a, b in zip(after, before)])))

    async def scenario() -> tuple[list[float], list[float]]:
        honest_added = [await added(honest, f"h{i}", 1.0) for i in range(50)]  # past its probation
        sybil_added = []
        for i in range(21):
            sybil_added.append(await added(sybils[i % 7], f"s{i}", 570.0))
            honest_added.append(await added(honest, f"h{50 + i}", 1.0))
        return honest_added, sybil_added

    try:
        honest_added, sybil_added = asyncio.run(scenario())
    finally:
        server.shutdown()
    refused = sybil_added.count(0.0)  # once the window holds 64 norms, 570× is over its settled bound (100×)
    assert min(honest_added) > 0 and 0 < refused < 21 and server.counters["refused_gradient"] == refused
    assert 0 < max(sybil_added) <= max(honest_added), (max(sybil_added), max(honest_added))
    assert server.counters["clipped_gradient"] >= 21 - refused and all(server.screen.on_probation(s) for s in sybils)
