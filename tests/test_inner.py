"""The inner optimizer factory: warmup, cosine decay, parameter groups, schedule offset."""

import pytest
import torch

from optim.config import InnerOptimConfig
from optim.inner import clip_and_step, lr_factor, make_inner_optimizer

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
