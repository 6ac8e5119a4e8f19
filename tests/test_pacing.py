"""Paced compute (``--pace-as``, swarm/pipeline/pacing.py): servers and trainers that wait a reference device's time
and replay recorded boundary tensors, with frames, codecs and the pipeline real.

    $ python3 -m pytest -q tests/test_pacing.py          # the slow one starts a paced swarm on loopback
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch

from compress.codecs import get_codec
from swarm.config import SwarmConfig, derive_config
from swarm.errors import ConfigError
from swarm.model.reference import FORWARD_SHARE, REFERENCE_RATES, reference_rate
from swarm.node.config import PeerConfig
from swarm.pipeline.pacing import Boundaries, Pace, random_tokens, record_boundaries
from swarm.pipeline.protocol import Backward, Forward
from swarm.pipeline.server import StageServer
from swarm.plan.measure import measure, random_batches
from swarm.plan.shapes import reference_compute

RATE = 20_000.0  # tokens/s of one process on the tiny model: a microbatch of 4 × 128 paced at ~26 ms


@pytest.fixture(scope="module")
def cfg() -> SwarmConfig:
    return derive_config(SwarmConfig(), {"stages.num_stages": 2, "codecs.activations": "int8"})


@pytest.fixture(scope="module")
def bank(cfg: SwarmConfig) -> Boundaries:
    return record_boundaries(cfg, *random_tokens(cfg))


def pace_of(cfg: SwarmConfig, bank: Boundaries) -> tuple[Pace, list[float]]:
    """A pace whose waits are recorded instead of slept."""
    waits: list[float] = []
    pace = dataclasses.replace(Pace.of(cfg, str(RATE), bank), sleep=waits.append)
    return pace, waits


def test_the_recording_is_one_real_microbatch_at_the_swarms_shapes(cfg: SwarmConfig, bank: Boundaries) -> None:
    shape = (cfg.train.microbatch_size, cfg.train.seq_len, cfg.model.d_model)
    assert bank.shape == shape and bank.stages == 2
    assert len(bank.activations) == len(bank.gradients) == 3
    assert all(torch.isfinite(t).all() for t in (*bank.activations, *bank.gradients))
    assert all(t.abs().max() > 0 for t in bank.gradients)  # real gradients, not zeros
    assert 4.0 < bank.loss < 7.0  # ~ln(256) at the seeded weights


def test_boundaries_round_trip_through_a_file_and_refuse_another_swarms_shapes(
    cfg: SwarmConfig, bank: Boundaries, tmp_path: Path
) -> None:
    bank.save(tmp_path / "b.pt")
    loaded = Boundaries.load(tmp_path / "b.pt")
    assert all(torch.equal(a, b) for a, b in zip(loaded.activations, bank.activations, strict=True))
    assert loaded.loss == bank.loss
    loaded.check(cfg)
    with pytest.raises(ValueError, match="record them at its shapes"):
        loaded.check(derive_config(cfg, {"train.seq_len": 64}))


def test_the_pace_is_the_plans_reference_compute_split_forward_and_backward(cfg: SwarmConfig, bank: Boundaries) -> None:
    pace = Pace.of(cfg, str(RATE), bank)
    plan = reference_compute(cfg, tokens_per_s=RATE)
    assert pace.seconds[1:] == pytest.approx(plan.stages) and pace.seconds[0] == pytest.approx(plan.trainer)
    assert sum(pace.seconds) == pytest.approx(cfg.train.microbatch_size * cfg.train.seq_len / RATE)
    assert pace.forward_s(1) + pace.backward_s(1) == pytest.approx(pace.seconds[1])
    assert pace.forward_s(1) == pytest.approx(FORWARD_SHARE * pace.seconds[1])
    assert reference_rate("h200", "125m") == REFERENCE_RATES["h200"]["125m"]
    with pytest.raises(ValueError, match="give one process's tokens/s"):
        Pace.of(cfg, "h200", bank)  # the tiny preset has no H200 rate


def test_a_paced_server_waits_the_reference_time_and_replies_with_the_recorded_tensors(
    cfg: SwarmConfig, bank: Boundaries
) -> None:
    pace, waits = pace_of(cfg, bank)
    server = StageServer(cfg, 2, pace=pace)
    before = [p.detach().clone() for p in server.module.parameters()]
    codec = get_codec("int8", kind="activation")
    grad_codec = get_codec("int8", kind="gradient")
    x = codec.encode(bank.activations[1])
    try:
        reply = asyncio.run(server.forward("trainer", Forward(mb="mb0", stage=2, prev_stage=1, x=x)))
        y = codec.decode(reply)
        assert y.shape == bank.shape
        assert torch.equal(y, codec.decode(codec.encode(bank.activations[2])))  # the recording, through the codec
        assert waits[-1] == pytest.approx(pace.forward_s(2), abs=0.02) and waits[-1] <= pace.forward_s(2)
        assert reply.compute_s is not None and reply.compute_s < pace.forward_s(2)  # sleeps recorded, not slept
        grad = grad_codec.encode(bank.gradients[2])
        reply = asyncio.run(server.backward("trainer", Backward(mb="mb0", stage=2, grad=grad)))
        assert torch.equal(grad_codec.decode(reply), grad_codec.decode(grad_codec.encode(bank.gradients[1])))
        assert waits[-1] == pytest.approx(pace.backward_s(2), abs=0.02)
        assert server.counters["paced_backward"] == 1 and server.counters["backward"] == 1
        for _ in range(cfg.train.inner_batch // cfg.train.microbatch_size - 1):  # the rest of an inner step
            asyncio.run(server.forward("trainer", Forward(mb="mb1", stage=2, prev_stage=1, x=x)))
            asyncio.run(server.backward("trainer", Backward(mb="mb1", stage=2, grad=grad)))
        assert server.inner_steps == 1  # steps are counted ...
        assert all(torch.equal(a, b) for a, b in zip(before, server.module.parameters()))  # ... and move nothing
    finally:
        server.shutdown()


def test_a_replayed_tensor_is_encoded_once_and_any_other_each_time(cfg: SwarmConfig, bank: Boundaries) -> None:
    pace = Pace.of(cfg, str(RATE), bank)
    codec = get_codec("int8", kind="activation")
    first = pace.encode(codec, pace.output(1, cfg.train.microbatch_size).detach(), None)
    assert first == codec.encode(bank.activations[1])
    assert pace.encode(codec, bank.activations[1], None) is first  # the frame kept, not encoded again
    other = bank.activations[1].clone()
    assert pace.encode(codec, other, None) is not first and pace.encode(codec, other, None) == first


def test_a_paced_pipeline_runs_at_the_reference_pace_with_real_frames(cfg: SwarmConfig, bank: Boundaries) -> None:
    """In process, a paced trainer through paced servers: each stage takes its reference time (plus this CPU's
    decoding), the frames are the recorded tensors' real ones, and nothing is checked or probed."""
    pace = Pace.of(cfg, str(RATE), bank)
    m = measure(cfg, random_batches(cfg), steps=1, warmup_steps=0, pace=pace)
    for measured, reference in zip(m.compute.stages, pace.seconds[1:], strict=True):
        assert reference <= measured < reference + 0.5  # the wait, and the CPU's codecs around it
    int8 = get_codec("int8", kind="activation")
    assert m.frames.out[0] == len(int8.encode(bank.activations[1]))
    assert m.frames.into[0] == len(int8.encode(bank.activations[0]))
    assert m.frames.into[1] == m.frames.out[0]  # stage 1's output frame relayed to stage 2 as it came


def test_pace_as_is_a_checked_per_peer_option() -> None:
    assert PeerConfig(pace_as="h200").to_argv() == ["--pace-as", "h200"]
    assert PeerConfig.from_flat({"pace_as": "150000", "pace_boundaries": Path("b.pt")}).pace_boundaries == Path("b.pt")
    for bad in ("tpu", "0", "-5"):
        with pytest.raises(ConfigError, match="pace_as"):
            PeerConfig(pace_as=bad)
    with pytest.raises(ConfigError, match="pacing is for trainers and stage servers"):
        PeerConfig(role="full", pace_as="h200")
    with pytest.raises(ConfigError, match="pace_boundaries"):
        PeerConfig(pace_boundaries=Path("b.pt"))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_paced_swarm_on_loopback_trains_its_steps_with_checks_off(
    cfg: SwarmConfig, bank: Boundaries, tmp_path: Path
) -> None:
    """``--pace-as`` through ``swarmloco local``'s peers: every hop real, no microbatch failed, no validation pass."""
    from peer.launch import LocalSwarm
    from swarmtest.bench import run_swarm

    bank.save(tmp_path / "bank.pt")
    layout = LocalSwarm(peers=3, stages=2, trainers=1, steps=3)
    peer = PeerConfig(pace_as=str(RATE), pace_boundaries=tmp_path / "bank.pt")
    result = run_swarm(cfg, layout, None, tmp_path / "run", peer=peer)
    assert result["microbatches"]["completed"] >= 3 * cfg.train.inner_batch // cfg.train.microbatch_size
    assert result["failed_hops"] == result["skipped_hops"] == 0
    assert result["val_loss"] is None  # a paced trainer runs no validation pass
    assert result["tokens_per_s"] > 0
