"""Which role and stage a ``--role auto`` peer takes (``choose_role``), from the stages' records.

>>> choose_role(pipeline_replicas(await membership.all_replicas()), num_stages=4)   # ("stage", 2), say
"""

from __future__ import annotations

from hivemind.p2p import PeerID

from swarm.dht.membership import pick_stage
from swarm.dht.records import StageStatus, serving
from swarm.model.stages import EDGE_STAGE
from swarm.recovery.rebalance import Snapshot, StageLoad, choose_stage_for_newcomer


def stage_loads(replicas: dict[int, dict[PeerID, StageStatus]], num_stages: int) -> Snapshot:
    """The rebalancer's view of the DHT records: each middle stage's servers and their throughput (a full peer's record
    is none: it takes no pipeline traffic, so a stage it alone holds is a hole in every path)."""
    return {
        stage: [
            StageLoad(peer_id=peer.to_base58(), throughput=status.samples_per_s)
            for peer, status in serving(replicas.get(stage, {})).items()
        ]
        for stage in range(1, num_stages + 1)
    }


def choose_role(
    replicas: dict[int, dict[PeerID, StageStatus]], num_stages: int, *, whole_model_fits: bool = False
) -> tuple[str, int]:
    """``--role auto``: (role, stage) this swarm needs most, in this order.

    1. A middle stage nobody serves is a hole in every path: serve it (the lowest such stage).
    2. With no trainer nothing trains: become one (stage 0).
    3. A peer that holds the whole model (``whole_model_fits``) in a pipeline that needs no more servers (``pipeline_is_served``:
       every middle stage has ``FULL_AFTER_SERVERS`` servers and none has requests waiting) becomes a full peer:
       one more server would sit idle, one more whole-model replica trains on its own data, sends no activations, and
       holds a copy of every stage that a lost stage is downloaded from instead of rebuilt.
    4. Otherwise serve the bottleneck, the stage with the least total throughput (SWARM's rule for newcomers).

    ``replicas`` are the pipeline's (``pipeline_replicas``): a full peer neither fills a hole in the paths nor drives
    them as a trainer.
    """
    loads = stage_loads(replicas, num_stages)
    empty = [stage for stage, servers in loads.items() if not servers]
    if empty:
        return "stage", empty[0]
    if not replicas.get(EDGE_STAGE):
        return "trainer", EDGE_STAGE
    if whole_model_fits and pipeline_is_served(replicas, num_stages):
        return "full", EDGE_STAGE
    try:
        return "stage", choose_stage_for_newcomer(loads)
    except ValueError:  # a server caught mid-move is listed in two stages: count replicas instead
        return "stage", pick_stage(replicas)


# servers per middle stage before ``--role auto`` prefers a full peer: one may fail and the paths still run
FULL_AFTER_SERVERS = 2


def pipeline_is_served(replicas: dict[int, dict[PeerID, StageStatus]], num_stages: int) -> bool:
    """Every middle stage has ``FULL_AFTER_SERVERS`` servers and no server has a request waiting (a record's queue counts
    the request running too): one more server would add capacity nobody is asking for."""
    servers = [serving(replicas.get(stage, {})) for stage in range(1, num_stages + 1)]
    return all(
        len(stage) >= FULL_AFTER_SERVERS and all(status.queue <= 1 for status in stage.values()) for stage in servers
    )
