"""NoLoCo: pairwise gossip outer step (optim/noloco.py)."""

from __future__ import annotations

import pytest
import torch

from compress.codecs import get_codec
from optim.noloco import NoLoCo, partners


@pytest.mark.parametrize("count", [2, 3, 4, 5, 8])
def test_partners_cover_every_member_once_in_pairs(count: int) -> None:
    for round_ in range(5):
        groups = partners(count, round_)
        assert sorted(i for g in groups for i in g) == list(range(count))
        assert all(len(g) == 2 for g in groups[:-1]) and len(groups[-1]) == (3 if count % 2 else 2)
        assert groups == partners(count, round_)  # every member computes the same pairing


def _replica(weights: torch.Tensor, lr: float = 0.7, momentum: float = 0.0) -> tuple[NoLoCo, dict[str, torch.Tensor]]:
    local = {"w": weights.clone()}
    return NoLoCo(local, lr=lr, momentum=momentum, codec=get_codec("fp32")), local


def test_step_is_mean_delta_plus_pull_towards_the_partner() -> None:
    torch.manual_seed(0)
    a, local_a = _replica(torch.randn(8, 4))
    b, local_b = _replica(torch.randn(8, 4))
    theta_a, theta_b = a.global_params["w"].clone(), b.global_params["w"].clone()
    common = 0.1 * torch.randn(8, 4)  # the replicas descend alike (opposed Δs are guarded: test_outer_robust.py)
    local_a["w"] -= common + 0.05 * torch.randn(8, 4)
    local_b["w"] -= common + 0.05 * torch.randn(8, 4)
    delta_a, delta_b = theta_a - local_a["w"], theta_b - local_b["w"]
    payloads = [a.make_payload(local_a), b.make_payload(local_b)]
    assert a.apply(payloads, local_a).used == 2 and b.apply(payloads, local_b).used == 2
    mean_delta, mean_theta = (delta_a + delta_b) / 2, (theta_a + theta_b) / 2
    torch.testing.assert_close(a.global_params["w"], theta_a - 0.7 * (mean_delta + theta_a - mean_theta))
    torch.testing.assert_close(b.global_params["w"], theta_b - 0.7 * (mean_delta + theta_b - mean_theta))
    torch.testing.assert_close(local_a["w"], a.global_params["w"])  # local reset to the new outer weights


def test_gossip_brings_replicas_together_without_an_all_reduce() -> None:
    torch.manual_seed(1)
    replicas = [_replica(torch.randn(16), lr=0.5) for _ in range(4)]
    spread = lambda: torch.stack([opt.global_params["w"] for opt, _ in replicas]).std(dim=0).mean().item()
    before = spread()
    for _ in range(12):  # no training between rounds: only the consensus term acts
        payloads = [opt.make_payload(local) for opt, local in replicas]
        for opt, local in replicas:
            assert opt.apply(payloads, local).used == 2  # my partner and I, never the whole group
    assert spread() < 0.01 * before
