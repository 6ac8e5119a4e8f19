"""What one replica's outer step holds between rounds (``SyncState``), besides its outer optimizer.

The outer optimizer keeps the round and the global weights (they move together, with its buffers, in a download or
a checkpoint); everything else ``ReplicaSync`` decides on is here, one field each, so that the round rules
(``pacing``, ``following``, ``install``) are plain functions of it and of the records, testable without a network
or a clock.

    >>> state = SyncState(synced_at=holder.inner_steps, global_hash=weights_hash(outer.global_params))
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from swarm.dht.records import StageStatus
from swarm.outer.download import Served


@dataclass(kw_only=True)
class SyncState:
    """One replica's standing in its stage's outer rounds (the round itself is its outer optimizer's)."""

    synced_at: int  # inner steps at the last snapshot or download: the next round is due H steps later
    global_hash: str  # ``weights_hash`` of the global weights: this replica's claim ("" without an outer step)
    others: Mapping[str, StageStatus] = field(default_factory=dict)  # the stage's other replicas, as last read
    last_group: tuple[str, ...] = ()  # contributors of the last round done
    same_entry: tuple[str, ...] = ()  # those of them that entered it from this replica's global weights
    lone_leader: str | None = None  # the leader of the last round, if it closed it alone before this one came
    alone_until: float | None = None  # after a round alone with others listed: until when (monotonic) it waits
    ahead: Served | None = None  # a state served before its holder's record claimed it (kept until vouched)
    moved: float = 0.0  # how far the last round installed moved the global weights (at most)
    announced_round: int | None = None  # the round of this replica's last record (``status_fields``)
