"""The typed events a peer logs: one frozen dataclass per kind, each one line of the peer's JSONL file.

A part emits through an ``EventSink``; the peer's writer stamps the event (time, name, memory peaks) and writes
``to_record()``; readers get the same types back with ``parse_event`` (an unknown kind raises ``UnknownEvent``).
A progress record (a role's numbers, no ``"event"`` key) is a ``Progress``. The lines are those of before the types.

>>> on_log(StateDownload(stage=1, reason="join", outer_round=3))          # emit
>>> rounds = of_kind(read_events(out / "stage1-a.jsonl"), OuterRound)    # read (``parse_event`` for one record)
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

E = TypeVar("E", bound="Event")


class UnknownEvent(ValueError):
    """A record whose ``"event"`` names no kind of this module (or whose fields do not fit it)."""


def _encode(value: Any) -> Any:
    """A field's JSON value: a tuple as a list."""
    if isinstance(value, tuple):
        return [_encode(item) for item in value]
    return value


def _decode(value: Any) -> Any:
    """A field from its JSON value: a list as a tuple (the fields hold tuples: the events are frozen)."""
    return tuple(value) if isinstance(value, list) else value


def _field(*, key: str | None = None, optional: bool = False, decode: Callable[[Any], Any] | None = None) -> Any:
    """A field written under ``key`` (a JSON name Python cannot spell: ``from``), left out when None if ``optional`` (a
    field some emitters of the kind do not have), read back by ``decode`` (default: a JSON array as a tuple)."""
    metadata = {"key": key, "optional": optional, "decode": decode or _decode}
    return field(default=None, metadata=metadata) if optional else field(metadata=metadata)


@dataclass(frozen=True, kw_only=True)
class Stamp:
    """What a peer's JSONL writer adds around each event: when it was logged, by whom, and the process' memory peaks
    so far. An event with a ``peer`` field of its own (``Fault``, ``OuterStrike``) keeps that key: its stamp reads
    back without a peer."""

    time: float
    peer: str | None = None
    peak_rss_mb: float | None = None
    peak_gpu_mb: float | None = None  # once the process has used CUDA


@dataclass(frozen=True, kw_only=True)
class Event:
    """One kind of event: ``event`` is the name its records carry under ``"event"``."""

    event: ClassVar[str]
    stamp: Stamp | None = None  # set by the JSONL writer; None as emitted

    def stamped(self: E, stamp: Stamp) -> E:
        return dataclasses.replace(self, stamp=stamp)

    @property
    def time(self) -> float:
        """When it was logged: its stamp's time (an event read back from a peer's JSONL file has one)."""
        if self.stamp is None:
            raise ValueError(f"an unstamped {type(self).__name__} has no time")
        return self.stamp.time

    def to_record(self) -> dict[str, Any]:
        """The JSONL record: the stamp's time and peer, ``"event"``, the fields, the stamp's memory peaks."""
        record: dict[str, Any] = _stamp_head(self.stamp)
        record |= self._fields()
        return record | _stamp_tail(self.stamp)

    def _fields(self) -> dict[str, Any]:
        record: dict[str, Any] = {"event": self.event}
        for f in _event_fields(type(self)):
            value = getattr(self, f.name)
            if value is None and f.metadata["optional"]:
                continue
            record[f.metadata["key"] or f.name] = _encode(value)
        return record

    @classmethod
    def _from_fields(cls: type[E], record: Mapping[str, Any], stamp: Stamp | None) -> E:
        values = {}
        for f in _event_fields(cls):
            key = f.metadata["key"] or f.name
            if key in record:
                values[f.name] = f.metadata["decode"](record[key])
        try:
            return cls(stamp=stamp, **values)
        except TypeError as e:
            raise UnknownEvent(f"a {cls.event!r} record without the fields of {cls.__name__}: {e}") from None


EventSink = Callable[["Event"], None]  # the one way a part emits: ``on_log(event)``


@dataclass(frozen=True, kw_only=True)
class Progress(Event):
    """A role's progress record (no ``"event"`` key): a trainer's step, loss and rates, a stage server's counters, a
    full peer's both; its fields are the role's (``role`` among them) and change with it, so they stay a mapping."""

    event: ClassVar[str] = "progress"  # not written: a record without "event" is a progress record
    fields: Mapping[str, Any]

    @property
    def role(self) -> str:
        return str(self.fields["role"])

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    def _fields(self) -> dict[str, Any]:
        return dict(self.fields)


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
_STAMP_KEYS = ("time", "peer", "peak_rss_mb", "peak_gpu_mb")


def parse_event(record: Mapping[str, Any]) -> Event:
    """The event a JSONL record holds (``json.loads`` of a line); ``UnknownEvent`` if its kind is none of ``KINDS``."""
    if "event" not in record:
        stamp = _read_stamp(record, own=set())
        return Progress(stamp=stamp, fields={k: v for k, v in record.items() if k not in _STAMP_KEYS})
    kind = KINDS.get(record["event"])
    if kind is None:
        raise UnknownEvent(f"unknown event {record['event']!r} (known: {', '.join(sorted(KINDS))})")
    own = {f.metadata["key"] or f.name for f in _event_fields(kind)}
    if extra := set(record) - own - set(_STAMP_KEYS) - {"event"}:
        raise UnknownEvent(f"a {kind.event!r} record with fields {sorted(extra)} that {kind.__name__} has not")
    return kind._from_fields(record, _read_stamp(record, own=own))


def read_events(path: Path) -> list[Event]:
    """The events of a peer's JSONL file (none if there is no file yet); a last line still being written is left out."""
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [parse_event(json.loads(line)) for line in lines]


def of_kind(events: Iterable[Event], kind: type[E]) -> list[E]:
    """The events of one kind, in order: ``of_kind(read_events(path), OuterRound)``."""
    return [event for event in events if isinstance(event, kind)]


def _read_stamp(record: Mapping[str, Any], *, own: set[str]) -> Stamp | None:
    if "time" not in record:
        return None
    return Stamp(**{key: record[key] for key in _STAMP_KEYS if key in record and key not in own})


def _stamp_head(stamp: Stamp | None) -> dict[str, Any]:
    if stamp is None:
        return {}
    return {"time": stamp.time} | ({"peer": stamp.peer} if stamp.peer is not None else {})


def _stamp_tail(stamp: Stamp | None) -> dict[str, Any]:
    if stamp is None:
        return {}
    peaks = {"peak_rss_mb": stamp.peak_rss_mb, "peak_gpu_mb": stamp.peak_gpu_mb}
    return {key: value for key, value in peaks.items() if value is not None}


def _event_fields(kind: type[Event]) -> tuple[dataclasses.Field[Any], ...]:
    return tuple(f for f in dataclasses.fields(kind) if f.name != "stamp")
