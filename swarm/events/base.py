"""What every event is: its ``Stamp`` (when, who, memory peaks), the ``Event`` base and its JSON fields."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

E = TypeVar("E", bound="Event")
STAMP_KEYS = ("time", "peer", "peak_rss_mb", "peak_gpu_mb")  # what a stamp writes


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


def _read_stamp(record: Mapping[str, Any], *, own: set[str]) -> Stamp | None:
    if "time" not in record:
        return None
    return Stamp(**{key: record[key] for key in STAMP_KEYS if key in record and key not in own})


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
