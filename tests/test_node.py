"""The per-peer config tree, and ``Node``s run in this process (``swarmtest.node``): they join, train, die at a
scheduled step, and leave."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from peer.data import load_corpus
from swarm.config import SwarmConfig, TrainerOptions
from swarm.errors import ConfigError
from swarm.events import Fault, Progress, Serving
from swarm.faults import FaultSchedule
from swarm.node.config import PeerConfig
from swarm.node.context import DataFactory
from swarm.pipeline.trainer import Batch
from swarmtest.configs import DATA, FAST_TIMEOUTS, LOOPBACK_MADDRS, tiny_config
from swarmtest.faults import kill_at
from swarmtest.node import BackgroundNode


def test_a_flat_namespace_fills_the_tree_and_every_bad_value_names_its_field() -> None:
    peer = PeerConfig.from_flat(
        {"role": "stage", "stage": 2, "eval_every": 5, "initial_peers": None, "faults": "stage2-a@step=7,b@step=1"}
    )
    assert peer.trainer.eval_every == 5 and peer.initial_peers == [] and peer.host_maddrs == ["/ip4/0.0.0.0/tcp/0"]
    assert peer.fault_step("stage2-a") == 7 and peer.fault_step("trainer-0") is None
    assert (
        peer.rebalance_every_s == 0.0 and PeerConfig(role="stage").rebalance_every_s == 30.0
    )  # pinned to --stage: never moves
    bad = {
        "role": {"role": "server"},
        "stage": {"role": "trainer", "stage": 1},
        "steps": {"steps": 0},
        "threads": {"threads": -1},
        "checkpoint_every": {"checkpoint_every": 5},
        "faults": {"faults": "stage2-a@soon"},
        "colour": {"in_flight": 1, "colour": "red"},
    }
    for field, options in bad.items():
        with pytest.raises(ConfigError) as error:
            PeerConfig.from_flat(options)
        assert error.value.field == field, (field, error.value)
    with pytest.raises(ConfigError, match="trainer"):
        PeerConfig.from_flat({"log_every": 0})
    with pytest.raises(ConfigError, match="by step") as error:  # a peer cannot know a supervisor's clock
        PeerConfig(faults=FaultSchedule.parse("a@t=30s"))
    assert error.value.field == "faults"


def batches(data: Sequence[str], seed: int) -> DataFactory:
    corpus = load_corpus(data)

    def make(cfg: SwarmConfig, peer_id: str) -> tuple[Iterator[Batch], list[Batch]]:
        kw = dict(batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len)
        return corpus.sample_batches("train", seed=seed, **kw), corpus.val_batches(
            num_sequences=2 * kw["batch_size"], **kw
        )

    return make


def trainer(name: str, server: BackgroundNode, *, steps: int, faults: FaultSchedule | None = None) -> BackgroundNode:
    config = PeerConfig(
        role="trainer",
        name=name,
        initial_peers=server.maddrs,
        host_maddrs=LOOPBACK_MADDRS,
        steps=steps,
        trainer=TrainerOptions(log_every=1),
        faults=faults or FaultSchedule(),
    )
    return BackgroundNode(config, data=batches([DATA], seed=len(name)))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_nodes_in_this_process_train_and_a_fault_keyed_by_peer_and_step_stops_only_that_peer_there() -> None:
    cfg = tiny_config(stages=1, steps=200, outer={"method": "none"}, timeouts=FAST_TIMEOUTS)
    # the server's schedule names another peer only: it must not fire here
    with BackgroundNode(
        PeerConfig(role="stage", stage=1, name="stage1-a", host_maddrs=LOOPBACK_MADDRS, faults=kill_at({"x": 1})),
        cfg,
    ) as server:
        assert server.maddrs and server.events(Serving)
        with trainer("doomed", server, steps=200, faults=kill_at({"doomed": 4, "stage1-a": 2})) as doomed:
            last = doomed.result(timeout=180)  # ends by itself: the fault crashed it
            (fault,) = doomed.events(Fault)
            assert last is None and fault.peer == "doomed" and fault.action == "crash" and fault.stage == 0
            assert fault.step >= 4 and max(r["step"] for r in doomed.events(Progress) if r.role == "trainer") < 200
        # a crash retires nothing: the newcomer finds the dead trainer listed for stage 0, and must neither give up
        # on it nor crash, but wait out the record and start (here the dead one was the only trainer)
        assert server.call(lambda node: node.membership.replicas(0)), "the dead trainer's record is still listed"
        with trainer("trainer-1", server, steps=6) as survivor:  # the swarm goes on without the dead peer
            last = survivor.result(timeout=180)
            assert last["step"] == 6 and last["failed"] == 0 and not survivor.events(Fault)
        final = server.stop()
    assert final["role"] == "stage" and final["stage"] == 1 and final["backward"] >= 6 and not server.events(Fault)
