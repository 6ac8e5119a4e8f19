"""Every record a peer stores in the DHT, as strict pydantic schemas (hivemind's SchemaValidator checks them).

Records live under keys that hold the swarm id (``swarm/dht/membership.py`` builds them), one per
peer under its signed subkey, each with the protocol version so peers of another version ignore it.
Kept apart from the code that reads and writes them so that every subsystem can name its record
without importing the DHT layer.

    >>> StageStatus(samples_per_s=40.0, inner_steps=12).dict()["version"] == PROTOCOL_VERSION
    True
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Dict, Optional, TypeVar

import pydantic.v1 as pydantic

PROTOCOL_VERSION = 6  # 2: signed, owner-bound records, one round declaration per peer and stage; 3: blobs end with their hash, stage states are streams (swarmloco-stage-state-v2); 4: SparseLoCo sends 1-D tensors whole; 5: an outer payload is one zstd-coded frame; 6: global_hash hashes 16 MiB pieces (weights_hash), seeded weights are drawn per parameter chunk (seeded_init); bumped on any incompatible change of records or RPC messages
MAX_CONFIG_CHARS = 1 << 16
# A round declaration's time must be within this of the checking node's clock (hivemind's DHT time is the wall clock):
# far above any honest skew, and it keeps absurd times (0, the far future) out of every honest node.
MAX_DECLARED_TIME_OFFSET_S = 86400.0
K = TypeVar("K")  # how a caller names a peer: PeerID or its base58 text
MAX_REVOCATIONS_BYTES = 1 << 16  # a signed list grows ~60 bytes per revoked peer: about a thousand peers
# joining: not yet working (state download, waiting for stages)
STATES = (
    "joining",
    "serving",
    "training",
    "recovering",
)
MAX_KINDS = 16
# a peer's --name: also a file name (OUT/<name>.jsonl) and a dashboard label, so short and plain
PEER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
# A trainer's record names at most this many servers it condemned (``StageStatus.condemned``): the ones whose bans end
# last. An honest trainer condemns a handful; the bound keeps a record small whatever a trainer claims.
MAX_VERDICTS = 16
PEER_ID_PATTERN = r"^[1-9A-HJ-NP-Za-km-z]{1,64}$"  # a peer id as base58 text

# The field types. pydantic v1's constrained types are made by calls, which a type checker cannot read in an
# annotation: it reads the plain type each one constrains (pydantic's advice), pydantic the constraint.
if TYPE_CHECKING:
    Count = int
    AtLeastOne = int
    NonNegative = float
    Fraction = float
    GlobalHash = str
    ConfigHash = str
    ConfigToml = str
    Kind = str
    CodecKind = str
    Role = str
    PeerName = str
    State = str
    Device = str
    SignedRevocations = bytes
    PeerText = str
else:
    Count = pydantic.conint(ge=0, strict=True)
    AtLeastOne = pydantic.conint(ge=1, strict=True)
    NonNegative = pydantic.confloat(ge=0.0, strict=True, allow_inf_nan=False)
    Fraction = pydantic.confloat(ge=0.0, le=1.0, strict=True, allow_inf_nan=False)
    GlobalHash = pydantic.constr(regex=r"^([0-9a-f]{16})?$", strict=True)  # none yet, or 16 hex digits
    ConfigHash = pydantic.constr(regex=r"^[0-9a-f]{16}$", strict=True)
    ConfigToml = pydantic.constr(max_length=MAX_CONFIG_CHARS, strict=True)
    Kind = pydantic.constr(regex=r"^[a-z][a-z0-9_]{0,31}$", strict=True)  # activations, gradients, eval, ...
    CodecKind = pydantic.constr(regex=r"^[a-z][a-z0-9_+]{0,31}$", strict=True)  # int8, subspace+int8, ...
    Role = pydantic.constr(regex=r"^(trainer|stage|full)$", strict=True)  # full: the whole model (swarm/node/roles)
    PeerName = pydantic.constr(regex=PEER_NAME_PATTERN, strict=True)
    State = pydantic.constr(regex=rf"^({'|'.join(STATES)})$", strict=True)
    Device = pydantic.constr(regex=r"^[\w:.() -]{1,80}$", strict=True)
    SignedRevocations = pydantic.conbytes(max_length=MAX_REVOCATIONS_BYTES, strict=True)
    PeerText = pydantic.constr(regex=PEER_ID_PATTERN, strict=True)
ByteCounts = Dict[Kind, Count]
FrameCounts = Dict[CodecKind, Count]
Loss = Optional[NonNegative]


class StageStatus(pydantic.BaseModel):
    """What a peer tells the swarm about itself; strict types, as hivemind's SchemaValidator requires."""

    samples_per_s: NonNegative = 0.0  # throughput EMA
    queue: Count = 0  # requests waiting or running
    inner_steps: Count = 0  # hook for the outer step: H inner steps per round
    outer_round: Count = 0
    global_hash: GlobalHash = ""  # weights after that round: equal on agreeing replicas
    grad_norm: NonNegative = 0.0  # last inner step, pre-clip
    recovered: pydantic.StrictBool = False  # this replica was rebuilt from its neighbours (CheckFree), not downloaded
    # False: a full peer's record (``swarm/node/roles/full.py``), a replica for the outer step, state downloads and exports only,
    # never called for a microbatch. Came later with a default, so records without it stay valid (and serve).
    serves: pydantic.StrictBool = True
    # Trainers: the servers a referee found wrong (``swarm/pipeline/checking.py``) → when the ban ends (DHT time). The
    # replicas of their stages leave them out of the outer rounds meanwhile (``swarm/outer/verdicts.py``). Came later
    # with a default, as ``serves``.
    condemned: Dict[PeerText, NonNegative] = {}
    version: Count = PROTOCOL_VERSION

    @pydantic.validator("condemned")
    def _few_verdicts(cls, condemned: dict[str, float]) -> dict[str, float]:
        if len(condemned) > MAX_VERDICTS:
            raise ValueError(f"at most {MAX_VERDICTS} condemned servers, got {len(condemned)}")
        return condemned


def verdicts(bans: Mapping[object, float], *, now: float, dht_now: float) -> dict[str, float]:
    """A trainer's ``StageStatus.condemned``: of ``bans`` (server → end of its ban, on the clock that reads ``now``),
    the ``MAX_VERDICTS`` bans that end last and have not ended, by peer id text → end in DHT time (``dht_now``)."""
    # (a test's server names that are no base58 stay out, rather than make the record invalid)
    running = sorted(
        ((until, text) for peer, until in bans.items() if until > now and re.match(PEER_ID_PATTERN, text := str(peer))),
        reverse=True,
    )
    return {peer: dht_now + until - now for until, peer in running[:MAX_VERDICTS]}


def serving(records: Mapping[K, StageStatus]) -> dict[K, StageStatus]:
    """The records of replicas that take pipeline traffic (a full peer's do not): what routing and rebalancing count."""
    return {peer: status for peer, status in records.items() if status.serves}


class RecoveryClaim(pydantic.BaseModel):
    """A peer's claim to rebuild a stage nobody serves (``swarm/recovery/rebuild.py``); the lowest (priority, peer id) wins."""

    priority: Count  # 0: a joining peer, 1: a server the rebalancer moves
    claimed_at: NonNegative  # DHT time
    version: Count = PROTOCOL_VERSION


class RoundDeclaration(pydantic.BaseModel):
    """A replica's arrival for outer round ``round`` of its stage (``swarm/outer/matchmaking.py``), one per peer and stage.

    The round is in the record, not in its key, so every stage has one declarations key that the
    DHT's schema validator knows (keys holding round numbers could not be listed, so went unchecked).
    """

    round: Count
    opened_at: NonNegative  # DHT time
    version: Count = PROTOCOL_VERSION

    @pydantic.validator("opened_at")
    def _about_now(cls, opened_at: float) -> float:
        if abs(opened_at - time.time()) > MAX_DECLARED_TIME_OFFSET_S:
            raise ValueError(f"declared at {opened_at}, more than {MAX_DECLARED_TIME_OFFSET_S:.0f} s from now")
        return opened_at


class RevocationRecord(pydantic.BaseModel):
    """The authority's signed revocation list (``swarm/rpc/auth.py``) as a peer republishes it
    (``swarm/dht/revocations.py``); readers check the authority's signature, not the publisher's word."""

    signed: SignedRevocations
    version: Count = PROTOCOL_VERSION


class ConfigRecord(pydantic.BaseModel):
    hash: ConfigHash
    toml: ConfigToml


class PeerMetrics(pydantic.BaseModel):
    """One peer's numbers; strict types, as hivemind's SchemaValidator requires.

    ``name``, ``tokens``, ``uptime_s``, ``busy_fraction``, ``device``, ``window``, the staleness, ``frames_sent`` and
    ``dht_stores`` came later with
    defaults, so records without them stay valid; a node of an older release refuses records that carry them (its
    schema forbids unknown fields), as it refuses role "full".
    """

    role: Role
    name: Optional[PeerName] = None  # the peer's --name
    stage: Count  # 0 = trainers (the edge stage)
    state: State
    step: Count  # inner steps of its stage replica
    train_loss: Loss = None  # trainers: mean over the last logged steps
    val_loss: Loss = None  # trainers: the last validation pass
    tokens_per_s: NonNegative = 0.0  # over the last period
    tokens: Count = 0  # processed since the peer started (a counter, unlike the rate)
    uptime_s: NonNegative = 0.0  # since the peer started
    bytes_sent: ByteCounts = {}  # wire frames by kind, since the peer started
    bytes_received: ByteCounts = {}
    # activation and gradient frames sent, by codec (an adaptive swarm's mix: compress/adaptive.py), since it started
    frames_sent: FrameCounts = {}
    outer_round: Count = 0
    recoveries: Count = 0  # stages this peer rebuilt from their neighbours
    bans: Count = 0  # peers it refuses to call right now
    # stage servers: compute time over wall time in the last window (swarm/pipeline/metering.py BusyTime)
    busy_fraction: Optional[Fraction] = None
    # where it computes (``swarm.hardware.describe``): "cpu", "cuda:0 (NVIDIA H100 80GB HBM3)"
    device: Optional[Device] = None
    # trainers (swarm/pipeline/trainer.py): microbatches the window keeps in flight, and the inner steps between a
    # microbatch's start and its landing over the last logged steps
    window: Optional[AtLeastOne] = None
    staleness_mean: Optional[NonNegative] = None
    staleness_max: Optional[Count] = None
    # records the peer stored in the DHT since it started (stage, config, metrics, round declarations, claims…)
    dht_stores: Count = 0
    version: Count

    @pydantic.validator("bytes_sent", "bytes_received", "frames_sent")
    def _few_kinds(cls, counts: dict[str, int]) -> dict[str, int]:
        if len(counts) > MAX_KINDS:
            raise ValueError(f"at most {MAX_KINDS} kinds of traffic, got {len(counts)}")
        return counts
