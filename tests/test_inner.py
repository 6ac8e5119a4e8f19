"""The inner optimizer factory: warmup, cosine decay, parameter groups, schedule offset; no step on a non-finite
gradient norm, and the screen of outsized gradients."""

import logging
import math

import pytest
import torch

from optim.config import InnerOptimConfig
from optim.inner import GradNormScreen, clip_and_step, lr_factor, make_inner_optimizer
from swarm.model.step import InnerStep

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


def test_the_screen_refuses_non_finite_norms_always_and_outsized_ones_after_warmup() -> None:
    screen = GradNormScreen(ratio=10.0, window=5, warmup=3)
    assert screen.refusal(math.inf) and screen.refusal(math.nan)
    assert screen.refusal(1e30) is None, "in warm-up only finiteness is checked"
    for norm in (1.0, 2.0, 3.0):
        screen.accept(norm)
    assert screen.limit == 20.0  # 10 × the median of (1, 2, 3)
    assert screen.refusal(20.0) is None and "over 10× the median 2" in (screen.refusal(20.1) or "")
    for norm in (100.0, 100.0):  # outsized norms that got in cannot carry the median alone
        screen.accept(norm)
    assert screen.limit == 30.0
    with pytest.raises(ValueError):
        GradNormScreen(ratio=1.0)
