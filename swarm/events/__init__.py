"""The typed events a peer logs: one frozen dataclass per kind, each one line of the peer's JSONL file.

A part emits through an ``EventSink``; the peer's writer stamps the event (time, name, memory peaks) and writes
``to_record()``; readers get the same types back with ``parse_event`` (an unknown kind raises ``UnknownEvent``).
A progress record (a role's numbers, no ``"event"`` key) is a ``Progress``: a ``TrainerProgress``, ``StageProgress`` or
``FullProgress`` (progress.py; ``base.py`` holds ``Event`` and its ``Stamp``). The lines are those of before the types.

>>> on_log(StateDownload(stage=1, reason="join", outer_round=3))          # emit
>>> rounds = of_kind(read_events(out / "stage1-a.jsonl"), OuterRound)    # read (``parse_event`` for one record)
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from swarm.events.base import (
    STAMP_KEYS,
    E,
    Event,
    EventSink,
    Stamp,
    UnknownEvent,
    _event_fields,
    _field,
    _read_stamp,
)
from swarm.events.progress import (
    FullProgress,
    PipelineCounts,
    Progress,
    StageProgress,
    TrainerProgress,
    Training,
)

__all__ = [
    "KINDS",
    "E",
    "Event",
    "EventSink",
    "FullProgress",
    "PipelineCounts",
    "Progress",
    "StageProgress",
    "Stamp",
    "TrainerProgress",
    "Training",
    "UnknownEvent",
    "of_kind",
    "parse_event",
    "read_events",
]


@dataclass(frozen=True, kw_only=True)
class Spawned(Event):
    """The launcher started the peer's process (``peer/launch.py``): its stamp's time is the process' start."""

    event: ClassVar[str] = "spawned"


@dataclass(frozen=True, kw_only=True)
class Metrics(Event):
    """The peer published its metrics record to the DHT (what the dashboard reads), at the stamp's time."""

    event: ClassVar[str] = "metrics"
    metrics: Mapping[str, Any] = _field()  # ``PeerMetrics.dict()`` (events is a leaf: it imports no record type)


@dataclass(frozen=True, kw_only=True)
class Fault(Event):
    """An injected fault (``--fault-at``): the peer dies at its inner step ``step`` (``action``: kill or crash)."""

    event: ClassVar[str] = "fault"
    peer: str = _field()  # this peer's --name
    step: int = _field()
    stage: int = _field()
    action: str = _field()


@dataclass(frozen=True, kw_only=True)
class Revocations(Event):
    """The peer adopted revocation list ``sequence`` (``revoked`` peers) from ``source`` (``file`` or ``dht``)."""

    event: ClassVar[str] = "revocations"
    sequence: int = _field()
    revoked: int = _field()
    source: str = _field()


@dataclass(frozen=True, kw_only=True)
class Move(Event):
    """A stage server moved from one stage to another (rebalancing); the state downloaded or rebuilt, or neither."""

    event: ClassVar[str] = "move"
    from_stage: int = _field(key="from")
    to_stage: int = _field(key="to")
    downloaded: bool = _field()
    rebuilt: bool = _field()


@dataclass(frozen=True, kw_only=True)
class Rollback(Event):
    """A starting stage server found no live replica and took its own checkpoint at ``path``."""

    event: ClassVar[str] = "rollback"
    stage: int = _field()
    schedule_step: int = _field()
    path: str = _field()


@dataclass(frozen=True, kw_only=True)
class StateDownload(Event):
    """The peer adopted a stage's state from another replica: on joining (``reason="join"``) or to catch up."""

    event: ClassVar[str] = "state_download"
    stage: int = _field()
    from_peer: str | None = _field(key="from", optional=True)  # the replica that delivered it
    reason: str = _field()
    vouched_by: int | None = _field(optional=True)  # holders of the claim it downloaded
    download_s: float | None = _field(optional=True)
    outer_round: int = _field()
    global_hash: str | None = _field(optional=True)


@dataclass(frozen=True, kw_only=True)
class StateServed(Event):
    """The peer sent its state of ``stage`` to another (``sha256``: the first 16 hex digits of the stream's)."""

    event: ClassVar[str] = "state_served"
    stage: int = _field()
    sha256: str = _field()


@dataclass(frozen=True, kw_only=True)
class Serving(Event):
    """A stage server takes requests for ``stage`` from now on."""

    event: ClassVar[str] = "serving"
    stage: int = _field()
    outer_round: int = _field()
    global_hash: str = _field()


@dataclass(frozen=True, kw_only=True)
class ServesStages(Event):
    """A full peer (``--serve``) takes requests for these stages."""

    event: ClassVar[str] = "serves_stages"
    stages: tuple[int, ...] = _field()


@dataclass(frozen=True, kw_only=True)
class Recovered(Event):
    """A stage server rebuilt a lost stage from its neighbours (``swarm/recovery/rebuild.py``) and installed it."""

    event: ClassVar[str] = "recovered"
    stage: int = _field()
    kind: str = _field()
    sources: tuple[Mapping[str, Any], ...] = _field()  # each source's summary (``Source.summary``)
    weights_hash: str = _field()
    rebuild_s: float = _field()
    installed_hash: str = _field()
    lr_scale: float = _field()
    saved: str | None = _field()  # where the merge was saved (None: the peer has no --out)


@dataclass(frozen=True, kw_only=True)
class StageCheckpoint(Event):
    """The peer wrote its stage's weights to ``path`` (a server every ``checkpoint_every`` steps, a trainer at its end)."""

    event: ClassVar[str] = "stage_checkpoint"
    stage: int = _field()
    inner_steps: int | None = _field(optional=True)
    path: str = _field()


@dataclass(frozen=True, kw_only=True)
class OuterDeclared(Event):
    """The replica declared itself for outer round ``round`` of ``stage`` (its window opened at ``opened_at``)."""

    event: ClassVar[str] = "outer_declared"
    stage: int = _field()
    round: int = _field()
    opened_at: float = _field()


@dataclass(frozen=True, kw_only=True)
class OuterRound(Event):
    """One outer round of ``stage`` ended (``outcome``: done, late, failed, …); the replica is at ``outer_round`` now."""

    event: ClassVar[str] = "outer_round"
    stage: int = _field()
    round: int = _field()
    outcome: str = _field()
    reason: str | None = _field()
    group: int = _field()
    contributors: int = _field()
    contributor_ids: tuple[str, ...] = _field()  # whose Δ is in the set
    leader: str | None = _field()
    outer_round: int = _field()
    global_hash: str = _field()
    round_s: float = _field()
    received_bytes: int = _field()
    dropped: tuple[str, ...] = _field()  # whose Δ the screening left out
    clipped: tuple[str, ...] = _field()  # whose Δ it clipped
    # whose Δ it scaled to the bound (the median member's norm, or a pair's ×2; no offence); None in older records
    bounded: tuple[str, ...] | None = _field(optional=True)


@dataclass(frozen=True, kw_only=True)
class OuterStrike(Event):
    """A strike against ``peer`` (a dropped Δ, a withheld commit, a false state); ``banned`` if it was the last straw."""

    event: ClassVar[str] = "outer_strike"
    stage: int = _field()
    peer: str = _field()  # the offender (this key holds no stamp: the logging peer's name is not in the line)
    reason: str = _field()
    banned: bool = _field()


KINDS: dict[str, type[Event]] = {
    kind.event: kind
    for kind in (
        Spawned,
        Metrics,
        Fault,
        Revocations,
        Move,
        Rollback,
        StateDownload,
        StateServed,
        Serving,
        ServesStages,
        Recovered,
        StageCheckpoint,
        OuterDeclared,
        OuterRound,
        OuterStrike,
    )
}


def parse_event(record: Mapping[str, Any]) -> Event:
    """The event a JSONL record holds (``json.loads`` of a line); ``UnknownEvent`` if its kind is none of ``KINDS``."""
    if "event" not in record:
        return Progress.from_json(record)
    kind = KINDS.get(record["event"])
    if kind is None:
        raise UnknownEvent(f"unknown event {record['event']!r} (known: {', '.join(sorted(KINDS))})")
    own = {f.metadata["key"] or f.name for f in _event_fields(kind)}
    if extra := set(record) - own - set(STAMP_KEYS) - {"event"}:
        raise UnknownEvent(f"a {kind.event!r} record with fields {sorted(extra)} that {kind.__name__} has not")
    return kind._from_fields(record, _read_stamp(record, own=own))


def read_events(path: Path) -> list[Event]:
    """The events of a peer's JSONL file (none if there is no file yet); a last line still being written is left out."""
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [parse_event(json.loads(line)) for line in lines]


def of_kind(events: Iterable[Event], kind: type[E]) -> list[E]:
    """The events of one kind, in order: ``of_kind(read_events(path), OuterRound)``."""
    return [event for event in events if isinstance(event, kind)]
