"""Full peers (``swarm/full.py``): the whole model in one process, one more replica of every stage, never on a path.

The records and the router are checked as units; a real swarm of ``Node``s in this process (``swarmtest.node``:
1 trainer, a server per stage of 2, a full peer) trains, meets in every stage's outer rounds, agrees, sends the
full peer no microbatch, and a newcomer server takes its stage from the full peer alone; a full peer with
``--serve`` is a trainer's only path through stages 1..S and still agrees with it in stage 0.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from pydantic.v1 import ValidationError

from optim.config import OuterOptimConfig
from peer.data import load_corpus
from peer.launch import LocalSwarm, local_config, peer_roles
from swarm.config import SwarmConfig, TrainerOptions
from swarm.config_toml import save_config
from swarm.dht.membership import pipeline_replicas
from swarm.dht.records import PeerMetrics, StageStatus
from swarm.errors import ConfigError
from swarm.events import (
    Event,
    Metrics,
    OuterRound,
    Progress,
    Serving,
    Spawned,
    Stamp,
    StateDownload,
    of_kind,
    read_events,
)
from swarm.node.config import PeerConfig
from swarm.node.context import DataFactory
from swarm.node.lifecycle import wait_for_replicas
from swarm.node.placement import choose_role, stage_loads
from swarm.node.roles.full import FullModel
from swarm.pipeline.routing import Router
from swarm.pipeline.trainer import Batch
from swarmtest.bench import swarm_summary
from swarmtest.configs import DATA, FAST_TIMEOUTS, LOOPBACK_MADDRS, outer_config, tiny_config
from swarmtest.node import BackgroundNode
from swarmtest.processes import swarmloco

H = 5
NUM_STAGES = 2


class Peer(str):
    """A peer id in a unit test: ``stage_loads`` asks for ``to_base58``."""

    def to_base58(self) -> str:
        return str(self)


def test_a_full_peers_record_is_never_routed_to_nor_counted_as_a_server() -> None:
    server, full = Peer("server"), Peer("full")
    records = {server: StageStatus(queue=1), full: StageStatus(serves=False)}
    router = Router(1, random.Random(0))
    router.update_records(1, records, task_size=8)
    assert router.balancers[1].live_peers() == [server]
    assert {router.choose(1, task_size=8) for _ in range(20)} == {server}
    router.update_records(1, {full: StageStatus(serves=False)})
    assert router.live_stages() == []  # a stage only a full peer holds is a hole in every path: skipped

    # an old record (no ``serves`` field) serves; one that says otherwise must be a strict bool
    assert StageStatus.parse_obj({"queue": 0}).serves is True
    with pytest.raises(ValidationError):
        StageStatus.parse_obj({"serves": "no"})

    # rebalancing and --role auto see the pipeline only: a full peer fills no hole and is no trainer
    everyone = {0: {full: StageStatus(serves=False)}, 1: {full: StageStatus(serves=False)}, 2: dict(records)}
    pipeline = pipeline_replicas(everyone)
    assert [load.peer_id for load in stage_loads(pipeline, 2)[2]] == ["server"]
    assert choose_role(pipeline, 2) == ("stage", 1)
    assert choose_role(pipeline_replicas({0: {full: StageStatus(serves=False)}, 1: records, 2: records}), 2) == (
        "trainer",
        0,
    )
    assert PeerMetrics(role="full", stage=0, state="training", step=3, version=3).role == "full"


def test_role_auto_picks_a_full_peer_only_where_the_whole_model_fits_and_the_pipeline_has_servers_to_spare() -> None:
    trainer, a, b, c, d = (Peer(name) for name in "tabcd")
    idle = StageStatus(queue=1, samples_per_s=10.0)  # the request it is running: nothing waits
    spare = {0: {trainer: StageStatus()}, 1: {a: idle, b: idle}, 2: {c: idle, d: idle}}
    assert choose_role(spare, 2, whole_model_fits=True) == ("full", 0)
    assert choose_role(spare, 2) == ("stage", 1)  # the whole model does not fit: the bottleneck (a tie: stage 1)
    waiting = {**spare, 2: {c: idle, d: StageStatus(queue=3, samples_per_s=5.0)}}  # requests wait: a server is needed
    assert choose_role(waiting, 2, whole_model_fits=True) == ("stage", 2)
    lone = {**spare, 2: {c: idle}}  # one server of stage 2: lose it and every path has a hole
    assert choose_role(lone, 2, whole_model_fits=True) == ("stage", 2)
    # a hole and a missing trainer still come first; a full peer's own records are no server
    assert choose_role({**spare, 2: {}}, 2, whole_model_fits=True) == ("stage", 2)
    assert choose_role({**spare, 0: {}}, 2, whole_model_fits=True) == ("trainer", 0)
    with_full = {**spare, 2: {c: idle, d: StageStatus(serves=False)}}
    assert choose_role(pipeline_replicas(with_full), 2, whole_model_fits=True) == ("stage", 2)


def test_a_full_replicas_own_boundaries_are_coded_only_when_the_swarm_says_so() -> None:
    corpus = load_corpus([DATA])
    cfg = full_config(10)
    inputs, targets = next(corpus.sample_batches("train", seed=0, batch_size=4, seq_len=cfg.train.seq_len))

    def one_microbatch(full_boundaries: str) -> tuple[FullModel, float]:
        codecs = dataclasses.replace(cfg.codecs, full_boundaries=full_boundaries)
        full = FullModel(dataclasses.replace(cfg, codecs=codecs), start_steps=[0] * 3, device=torch.device("cpu"))
        try:
            return full, full._train(inputs, targets)
        finally:
            full.shutdown()

    in_memory, exact = one_microbatch("none")
    coded, lossy = one_microbatch("compressed")
    assert in_memory.link is None and coded.link is not None
    # the embedding and each middle stage's output go through int8 forward, each gradient back: nothing crosses a wire
    assert coded.link.messages == {"activations": NUM_STAGES + 1, "activation_gradients": NUM_STAGES + 1}
    assert lossy != exact and abs(lossy - exact) < 0.05 * exact  # int8's rounding, nothing more
    grads = lambda full: torch.cat([p.grad.flatten() for p in full.model.parameters() if p.grad is not None])
    assert not torch.equal(grads(in_memory), grads(coded))
    with pytest.raises(ValidationError):
        PeerMetrics(role="oracle", stage=0, state="training", step=3, version=3)


def full_config(steps: int) -> SwarmConfig:
    return outer_config("sparseloco", inner_steps=H, stages=NUM_STAGES, steps=steps, timeouts=FAST_TIMEOUTS)


def batches(seed: int) -> DataFactory:
    corpus = load_corpus([DATA])

    def make(cfg: SwarmConfig, peer_id: str) -> tuple[Iterator[Batch], list[Batch]]:
        kw = dict(batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len)
        return corpus.sample_batches("train", seed=seed, **kw), corpus.val_batches(
            num_sequences=2 * kw["batch_size"], **kw
        )

    return make


def peer_id(node: BackgroundNode) -> str:
    assert node.node is not None and node.node.membership is not None
    return node.node.membership.peer_id.to_base58()


def rounds(node: BackgroundNode, stage: int) -> list[OuterRound]:
    return [r for r in node.events(OuterRound) if r.stage == stage and r.outcome == "done"]


def progress_of(node: BackgroundNode, role: str) -> list[Progress]:
    return [r for r in node.events(Progress) if r.role == role]


def shared_rounds(
    full: BackgroundNode, others: dict[int, BackgroundNode]
) -> dict[int, list[tuple[OuterRound, OuterRound]]]:
    """Per stage, the done rounds that the full peer and the stage's other replica both logged, with the other
    replica among the full peer's contributors: (the full peer's record, the other's)."""
    found = {}
    for stage, other in others.items():
        theirs = {(r.round, r.leader): r for r in rounds(other, stage)}
        found[stage] = [
            (r, theirs[r.round, r.leader])
            for r in rounds(full, stage)
            if peer_id(other) in r.contributor_ids and (r.round, r.leader) in theirs
        ]
    return found


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_full_peer_meets_every_stage_agrees_serves_no_path_and_seeds_a_newcomer() -> None:
    steps = 400
    cfg = full_config(steps)

    def server(stage: int, initial: list[str]) -> BackgroundNode:
        config = PeerConfig(
            role="stage", stage=stage, name=f"stage{stage}", initial_peers=initial, host_maddrs=LOOPBACK_MADDRS
        )
        return BackgroundNode(config, cfg if not initial else None)

    def trainer_like(role: str, initial: list[str]) -> BackgroundNode:
        config = PeerConfig(
            role=role,  # type: ignore[arg-type]  # a Role: "full" or "trainer"
            name=role,
            initial_peers=initial,
            host_maddrs=LOOPBACK_MADDRS,
            steps=steps,
            trainer=TrainerOptions(log_every=5),
        )
        return BackgroundNode(config, data=batches(seed=len(role)))

    with server(1, []) as stage1:
        with server(2, stage1.maddrs) as stage2, trainer_like("trainer", stage1.maddrs) as trainer:
            with trainer_like("full", stage1.maddrs) as full:
                others = {0: trainer, 1: stage1, 2: stage2}
                shared = full.wait(
                    "an outer round of every stage shared by the full peer and the stage's other replica",
                    lambda: (found := shared_rounds(full, others)) and all(found.values()) and found,
                    240,
                )
                # the members of a round applied one set: the same global weights, on the full peer and on the other
                for stage, pairs in shared.items():
                    for mine, theirs in pairs:
                        assert peer_id(full) in theirs.contributor_ids, (stage, theirs)
                        assert mine.global_hash == theirs.global_hash, (stage, mine, theirs)

                # every record the full peer announces says it takes no pipeline traffic
                listed = full.call(lambda node: node.membership.all_replicas())
                me = full.node.membership.peer_id
                assert all(me in listed[s] and listed[s][me].serves is False for s in range(NUM_STAGES + 1))
                # what it published, logged as it published it; its progress records carry no copy
                published = [r.metrics for r in full.events(Metrics)]
                assert published and published[-1]["role"] == "full"
                assert not any("metrics" in r for r in progress_of(full, "full"))

                trainer_records = progress_of(trainer, "trainer")

                # the newcomer: stage 1 held by the full peer alone, a new server takes its state from it
                stage1_round = full.call(lambda node: node.membership.replicas(1))[me].outer_round
                joined = stage1.stop()
                assert joined["role"] == "stage"
                with server(1, stage2.maddrs) as newcomer:
                    download = newcomer.events(StateDownload)[0]
                    assert download.reason == "join" and download.outer_round >= stage1_round
                    (serving,) = newcomer.events(Serving)
                    assert serving.global_hash
                    # never ahead of its only source: the full peer had logged that round by now (its DHT record may
                    # lag by an announce period; its log line follows an install at once, the newcomer's download not)
                    held = [
                        r.outer_round
                        for r in full.records
                        if isinstance(r, (OuterRound, StateDownload)) and r.stage == 1
                    ]
                    assert serving.outer_round <= max(held, default=0), (serving, held[-3:])
                full.stop()
            trainer.stop()
    # no microbatch ever went to the full peer: it serves no stage RPC, so one would have failed its hop
    assert trainer_records and all(r["hop_failures"] == 0 for r in trainer_records)
    assert trainer_records[-1]["completed"] > 0


def test_serve_is_for_full_peers_only_and_the_refusal_names_the_flag() -> None:
    assert PeerConfig.from_flat({"role": "full", "serve": True}).serve
    assert not PeerConfig(role="full").serve  # a full peer takes no pipeline traffic unless asked
    for role in ("trainer", "stage", "auto"):
        with pytest.raises(ConfigError, match="--serve is for --role full") as error:
            PeerConfig.from_flat({"role": role, "serve": True})
        assert error.value.field == "serve", role


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_serving_full_peer_carries_a_trainers_microbatches_through_its_stages_and_still_agrees() -> None:
    """1 trainer + 1 full peer with --serve, no stage server: the trainer's path is the full peer's stages 1..S."""
    cfg = full_config(steps=400)

    def peer(role: str, initial: list[str], **options: object) -> BackgroundNode:
        config = PeerConfig(
            role=role,  # type: ignore[arg-type]  # a Role: "full" or "trainer"
            name=role,
            initial_peers=initial,
            host_maddrs=LOOPBACK_MADDRS,
            steps=400,
            wait_for_replicas=2,  # both train once both are listed: they meet in stage 0 from its first round
            trainer=TrainerOptions(log_every=5),
            **options,  # type: ignore[arg-type]  # PeerConfig fields (serve=True)
        )
        return BackgroundNode(config, cfg if not initial else None, data=batches(seed=len(role)))

    with peer("full", [], serve=True) as full, peer("trainer", full.maddrs) as trainer:
        full.wait(
            "trainer microbatches completed through the full peer's stages",
            lambda: (
                (done := [r for r in progress_of(trainer, "trainer") if r["completed"] > 0])
                and (mine := [r for r in progress_of(full, "full") if r.get("served")])
                and all(
                    # served samples count on the stage's inner step: a served stage steps more than stage 0
                    mine[-1]["served"][str(s)]["backward"] > 0
                    and mine[-1]["served"][str(s)]["inner_steps"] > mine[-1]["step"]
                    for s in range(1, NUM_STAGES + 1)
                )
                and (done, mine)
            ),
            180,
        )
        shared = full.wait(
            "a stage-0 round shared by the full peer and the trainer",
            lambda: shared_rounds(full, {0: trainer})[0],
            180,
        )
        for mine, theirs in shared:  # the members of a round applied one set: the same global weights
            assert mine.global_hash == theirs.global_hash, (mine, theirs)
            assert peer_id(full) in theirs.contributor_ids, theirs

        # its middle stages are announced as a server's (routing and status count it), stage 0 as a trainer-side replica
        listed = full.call(lambda node: node.membership.all_replicas())
        me = full.node.membership.peer_id
        assert listed[0][me].serves is False
        assert all(listed[s][me].serves is True for s in range(1, NUM_STAGES + 1))
        assert set(pipeline_replicas(listed)[1]) == {me}  # the only server of stage 1
        trainer.stop()
        full.stop()
    # every hop went to the full peer (the only server) and none failed
    trainer_records = progress_of(trainer, "trainer")
    assert trainer_records[-1]["completed"] > 0
    assert all(r["hop_failures"] == 0 for r in trainer_records)


def test_local_layout_counts_full_peers_apart_and_rejects_a_negative_count() -> None:
    layout = LocalSwarm(peers=3, stages=2, full=2)
    assert layout.servers() == [("stage1-0", 1), ("stage2-0", 2)]  # full peers take no server's place
    assert local_config(SwarmConfig(), layout).data.shards == 3  # one shard per trainer and per full peer
    with pytest.raises(ValueError, match="full"):
        LocalSwarm(full=-1)


def test_a_local_swarm_of_full_peers_only_is_created_by_its_first_full_peer(tmp_path: Path) -> None:
    layout = LocalSwarm(peers=0, trainers=0, stages=2, full=2)
    assert layout.servers() == []
    roles = peer_roles(layout, local_config(SwarmConfig(), layout), tmp_path)
    assert [name for name, _ in roles] == ["full-0", "full-1"]  # full-0 first: it creates the swarm
    for _, peer in roles:  # every replica trains once both are listed; distinct shards
        assert peer.role == "full" and peer.wait_for_replicas == 2
    assert [peer.data_shard for _, peer in roles] == [0, 1]
    mixed = peer_roles(LocalSwarm(peers=3, trainers=1, stages=2, full=1), SwarmConfig(), tmp_path)
    assert [name for name, _ in mixed] == ["stage1-0", "stage2-0", "trainer-0", "full-0"]  # a server creates it
    assert all(peer.wait_for_replicas == 2 for name, peer in mixed if "stage" not in name)
    assert [peer.to_argv()[:4] for _, peer in mixed[:2]] == [["--role", "stage", "--stage", str(s)] for s in (1, 2)]
    with pytest.raises(ValueError, match="a trainer or a full peer"):
        LocalSwarm(peers=0, trainers=0, full=0)
    with pytest.raises(ValueError, match="--peers 0"):
        LocalSwarm(peers=2, trainers=0, stages=2, full=1)  # servers with no trainer would serve nobody
    with pytest.raises(ValueError, match="servers"):
        LocalSwarm(peers=1, trainers=1, stages=1, full=1)


class ListedReplicas:
    """A membership whose stage-0 listing grows by one replica per look, up to ``most``."""

    def __init__(self, most: int) -> None:
        self.most, self.looks = most, 0

    async def replicas(self, stage: int) -> dict[str, StageStatus]:
        assert stage == 0
        self.looks += 1
        return {f"peer{i}": StageStatus() for i in range(min(self.looks, self.most))}


def test_a_replica_trains_once_enough_replicas_are_listed_or_after_the_timeout(
    caplog: pytest.LogCaptureFixture,
) -> None:
    membership = ListedReplicas(most=2)
    asyncio.run(wait_for_replicas(membership, 2, timeout_s=30))  # type: ignore[arg-type]  # a stand-in Membership
    assert membership.looks == 2  # it looked until the second replica was listed, and no longer
    lonely = ListedReplicas(most=1)
    with caplog.at_level(logging.WARNING):
        asyncio.run(wait_for_replicas(lonely, 2, timeout_s=0.6))  # type: ignore[arg-type]  # a stand-in Membership
    assert lonely.looks >= 2 and "1 of 2 replicas of stage 0 seen" in caplog.text  # it gave up, and said so


def bench_records(name: str, role: str, **fields: object) -> list[Event]:
    """A peer's records as bench_swarm reads them: spawned, one done round, the last progress record."""
    done = OuterRound(
        stage=0,
        round=0,
        outcome="done",
        reason=None,
        group=2,
        contributors=2,
        contributor_ids=("a", "b"),
        leader="a",
        outer_round=1,
        global_hash="beef",
        round_s=0.5,
        received_bytes=0,
        dropped=(),
        clipped=(),
    )
    last = {"role": role, "tokens": 1000, "tokens_per_s": 100.0, "val_loss": 2.0 if role == "full" else 3.0}
    training = {"step": 10, "elapsed_s": 10.0, "train_loss": 3.0, "lr": 1e-3, "grad_norm": 1.0}
    return [Spawned(stamp=Stamp(time=0.0, peer=name)), done, Progress.from_json(training | last | fields)]


def test_bench_swarm_summarises_a_swarm_with_full_peers_or_only_full_peers() -> None:
    pipeline = {  # what a trainer's last progress record carries
        "wire_bytes": {"activations": 3000, "gradients": 5000},
        "fp32_bytes": {"activations": 12000, "gradients": 12000},
        **dict.fromkeys(("hop_failures", "hop_timeouts", "skipped_hops", "resent_inputs", "failed", "cancelled"), 0),
        **dict(started=10, completed=10),
    }
    peers = {
        "trainer-0": bench_records("trainer-0", "trainer", pseudo_grad_bytes=100, **pipeline),
        "full-0": bench_records("full-0", "full", pseudo_grad_bytes=300),  # its stages' pseudo-gradients, summed
    }
    mixed = swarm_summary(peers, LocalSwarm(peers=2, trainers=1, stages=1, full=1))
    assert mixed["tokens"] == 2000 and mixed["val_losses"] == {"trainer-0": 3.0, "full-0": 2.0}
    assert mixed["val_loss"] == 3.0  # trainer-0's
    assert mixed["bytes_per_token"] == {"activations": 1.5, "gradients": 2.5, "total": 4.0}  # per token of both
    assert mixed["pseudo_grad_bytes_per_token"] == 0.2  # the full peer's count too
    only_full = {name: bench_records(name, "full", pseudo_grad_bytes=300) for name in ("full-0", "full-1")}
    alone = swarm_summary(only_full, LocalSwarm(peers=0, trainers=0, stages=1, full=2))
    assert alone["tokens"] == 2000 and alone["val_loss"] == 2.0 and alone["bytes_per_token"]["total"] == 0
    assert alone["pseudo_grad_bytes_per_token"] == 0.3 and alone["microbatches"]["started"] == 0


def run_local(tmp_path: Path, layout: list[str], children: list) -> tuple[subprocess.CompletedProcess, Path]:
    """``swarmloco local`` with ``layout`` on the tiny 2-stage model (SparseLoCo every H steps); its result (asserted
    successful) and output folder."""
    toml, out = tmp_path / "tiny.toml", tmp_path / "run"
    save_config(
        tiny_config(stages=2, outer=OuterOptimConfig(warm_start_steps=0, method="sparseloco", inner_steps=H)), toml
    )
    (result,) = swarmloco(["local", "--config", str(toml), *layout, "--out", str(out)], children=children)
    assert result.returncode == 0, result.stdout + result.stderr
    return result, out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_swarmloco_local_with_a_full_peer_trains_and_lists_it(tmp_path: Path, child_processes: list) -> None:
    result, out = run_local(tmp_path, ["--steps", "20", "--full", "1"], child_processes)
    assert "1 full peer(s)" in result.stdout
    (row,) = [line for line in result.stdout.splitlines() if line.startswith("full-0 ")]
    assert row.split()[1] == "full", row
    records = read_events(out / "full-0.jsonl")
    assert max(r["step"] for r in of_kind(records, Progress) if r.role == "full") == 20
    stages = {r.stage for r in of_kind(records, OuterRound) if r.outcome == "done"}
    assert stages == {0, 1, 2}  # a replica of every stage


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_swarmloco_local_of_full_peers_only_meets_from_the_first_round(tmp_path: Path, child_processes: list) -> None:
    layout = ["--peers", "0", "--trainers", "0", "--full", "2", "--stages", "2", "--steps", str(4 * H + 2)]
    result, out = run_local(tmp_path, layout, child_processes)
    assert "0 trainer(s), 0 stage servers over 2 stages, 2 full peer(s)" in result.stdout
    rounds: dict[tuple[int, int], list[OuterRound]] = {}
    for name in ("full-0", "full-1"):
        for r in of_kind(read_events(out / f"{name}.jsonl"), OuterRound):
            rounds.setdefault((r.stage, r.round), []).append(r)
    # both full peers wait for each other before training (--wait-for-replicas), so neither runs a round alone: every
    # stage's H-step rounds (4 of them, the last 2 steps before the end) were done by both, with the same weights
    assert sorted(rounds) == [(stage, k) for stage in range(3) for k in range(4)]
    for key, records in rounds.items():
        assert len(records) == 2 and all(r.outcome == "done" and r.contributors == 2 for r in records), key
        assert records[0].global_hash == records[1].global_hash, key
