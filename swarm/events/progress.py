"""A role's progress record: the line a peer logs most often (no ``"event"`` key; ``"role"`` says whose it is).

One frozen dataclass per role, each built in one place: ``TrainerProgress`` by ``Trainer.progress``
(swarm/pipeline/trainer.py, the outer step's part added by ``TrainerRole``), ``StageProgress`` by
``ServedStage.record`` (swarm/node/roles/served.py), ``FullProgress`` by ``progress`` in swarm/node/roles/full.py.
The JSONL keys are the field names, as before the types (scripts/ and docs/data/ read them). Counters that are
open-ended (``hop_refused_<code>``, ``outer_<outcome>``, a server's ``forward``/``backward``…) stay in ``counters``,
written flat beside the fields; a trainer's fixed microbatch and hop counters (``PipelineCounts``) are written flat
too. ``Progress.from_json`` is the one parse (``parse_event`` uses it; a script holding a dict calls it).

    >>> last = of_kind(read_events(out / "trainer-0.jsonl"), TrainerProgress)[-1]; last.tokens_per_s
    >>> record = Progress.from_json(json.loads(line))   # a TrainerProgress, StageProgress or FullProgress
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from swarm.events.base import STAMP_KEYS, Event, UnknownEvent, _decode, _encode, _read_stamp

P = TypeVar("P", bound="Progress")
_OPTIONAL = {"optional": True}  # a field left out of the line when None (not every record of the role has it)


def _optional() -> Any:
    return field(default=None, metadata=_OPTIONAL)


@dataclass(frozen=True, kw_only=True)
class Progress(Event):
    """What every role's progress record holds. For scripts and tests reading a line as before, ``record["key"]``,
    ``record.get(key)`` and ``key in record`` read the JSON line's keys (the package reads the fields)."""

    event: ClassVar[str] = "progress"  # not written: a record without "event" is a progress record
    role: ClassVar[str] = ""  # written under "role": trainer, stage or full

    elapsed_s: float  # seconds since the role began training (a stage server: serving this stage)
    outer_round: int | None = _optional()  # the replica's outer round (a full peer's are per stage: outer_rounds)
    global_hash: str | None = _optional()  # the hash of its stage's global weights at that round
    # open-ended counters, written flat (a trainer's hop_refused_<code>; the outer step's outer_<outcome>,
    # outer_condemned, pseudo_grad_bytes…; a server's forward, backward, cache_miss…): present once counted
    counters: Mapping[str, int] = field(default_factory=dict)

    def count(self, name: str) -> int:
        """An open-ended counter (0 if never counted)."""
        return self.counters.get(name, 0)

    @property
    def fields(self) -> dict[str, Any]:
        """The JSON line's keys without the stamp (what a dict record held before the types)."""
        return self._fields()

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self.fields

    def _fields(self) -> dict[str, Any]:
        record: dict[str, Any] = {"role": self.role}
        for f in _progress_fields(type(self)):
            value = getattr(self, f.name)
            if f.metadata.get("flat"):
                record |= dataclasses.asdict(value)
            elif not (value is None and f.metadata.get("optional")):
                record[f.name] = _encode(value)
        return record | dict(self.counters)

    @classmethod
    def from_json(cls: type[P], record: Mapping[str, Any]) -> P:
        """The progress record a JSONL line holds (``json.loads`` of it; a stamp's keys, if any, become its stamp):
        the role's type, each key not a field counted in ``counters``. ``UnknownEvent`` for another role or a
        record without the role's fields."""
        kind = ROLES.get(record.get("role", ""))
        if kind is None or not issubclass(kind, cls):
            known = ", ".join(role for role, k in ROLES.items() if issubclass(k, cls))
            raise UnknownEvent(f"a {cls.__name__} of role {record.get('role')!r} (known: {known})")
        values: dict[str, Any] = {}
        taken = {"role", *STAMP_KEYS}
        for f in _progress_fields(kind):
            if nested := f.metadata.get("flat"):
                names = [n.name for n in dataclasses.fields(nested)]
                values[f.name] = nested(**{name: record[name] for name in names if name in record})
                taken.update(names)
            elif f.name in record:
                values[f.name] = _decode(record[f.name])
                taken.add(f.name)
        counters = {key: value for key, value in record.items() if key not in taken}
        try:
            return kind(stamp=_read_stamp(record, own=set()), counters=counters, **values)
        except TypeError as e:
            raise UnknownEvent(f"a {kind.role!r} progress record without the fields of {kind.__name__}: {e}") from None


@dataclass(frozen=True, kw_only=True)
class Training(Progress):
    """What a replica of stage 0 that trains (a trainer, a full peer) reports of its training."""

    step: int  # inner steps of stage 0 taken
    tokens: int  # tokens trained on (a trainer: of the microbatches landed and not dropped since by a download)
    train_loss: float | None  # mean loss of the microbatches since the last record (None: none finished)
    val_loss: float | None = _optional()  # mean validation loss (only at an evaluation: eval_every, the last step)
    tokens_per_s: float  # tokens / elapsed_s
    lr: float  # stage 0's inner learning rate now
    grad_norm: float  # stage 0's gradient norm at its last inner step, before clipping


def training_fields(
    *, step: int, tokens: int, elapsed_s: float, losses: list[float], lr: float, grad_norm: float
) -> dict[str, Any]:
    """The fields of ``Training`` a trainer and a full peer fill alike, from their counts since the run's start and the
    losses of the microbatches finished since the last record."""
    return {
        "step": step,
        "tokens": tokens,
        "elapsed_s": elapsed_s,
        "train_loss": sum(losses) / len(losses) if losses else None,
        "tokens_per_s": tokens / max(elapsed_s, 1e-9),
        "lr": lr,
        "grad_norm": grad_norm,
    }


@dataclass(frozen=True, kw_only=True)
class PipelineCounts:
    """A trainer's microbatch and hop counters (``COUNTERS`` in swarm/pipeline/trainer.py says what each counts),
    written flat. Microbatches: started = completed + failed + cancelled + in flight."""

    started: int = 0  # microbatches started
    completed: int = 0  # landed (their stage-0 gradients taken, or dropped as below)
    failed: int = 0  # failed (a hop with no replica left, or a bug)
    cancelled: int = 0  # cancelled at shutdown
    stale_dropped: int = 0  # of the completed: landed more than max_staleness inner steps after their start
    round_dropped: int = 0  # of the completed: began before a download replaced the weights
    hop_failures: int = 0  # hop attempts that failed (retried elsewhere)
    hop_timeouts: int = 0  # hop deadlines missed
    skipped_hops: int = 0  # stages skipped on the way forward (no live replica, or the path sampled past them)
    resent_inputs: int = 0  # inputs resent for a backward (the server had evicted them)
    deadline_bans: int = 0  # servers banned for deadlines missed in a row
    checks: int = 0  # forwards checked against another replica
    check_disagreements: int = 0  # checks whose outputs were apart (judged by their loss)
    check_strikes: int = 0  # servers condemned (their backwards failed probes against their own forwards)
    checks_unresolved: int = 0  # disagreements no loss could settle
    check_failures: int = 0  # outputs that failed their loss judgement
    checks_behind: int = 0  # outputs worse than the other's, yet better than skipping the stage
    check_rests: int = 0  # servers found unfit (outputs worse than no work), routed around until they sync
    probes: int = 0  # backward probes judged
    probe_failures: int = 0  # probes failed
    probes_unresolved: int = 0  # probes whose step the replies' rounding swallowed
    probes_unanswered: int = 0  # probes not answered (refused: the weights gone; or no reply)

    @property
    def in_flight(self) -> int:
        return self.started - self.completed - self.failed - self.cancelled


@dataclass(frozen=True, kw_only=True)
class TrainerProgress(Training):
    """A trainer's record: its training, its window of microbatches in flight, its counters and its traffic."""

    role: ClassVar[str] = "trainer"

    window: int = 0  # microbatches it lets be in flight now (the transport window)
    round_trip_s: float | None = None  # the lowest recent round trip of a microbatch, seconds (None: none yet)
    microbatches_per_s: float | None = None  # the highest recent delivery rate, microbatches per second
    staleness_mean: float | None = None  # inner steps between start and landing, mean over those since the last record
    staleness_max: int | None = None  # and their most (None: none landed since)
    pipeline: PipelineCounts = field(default_factory=PipelineCounts, metadata={"flat": PipelineCounts})
    wire_bytes: Mapping[str, int] = field(default_factory=dict)  # frame bytes on the wire by kind, sent + received
    fp32_bytes: Mapping[str, int] = field(default_factory=dict)  # what the same tensors cost as raw fp32, by kind
    frames_sent: Mapping[str, int] = field(default_factory=dict)  # frames sent, by codec
    links: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # per peer: codecs chosen, bytes/s measured
    condemned: tuple[str, ...] = ()  # servers whose work contradicted itself (a failed probe), banned now

    def refused_hops(self) -> int:
        """Hops the servers refused (``hop_refused_<code>``, all codes)."""
        return sum(n for key, n in self.counters.items() if key.startswith("hop_refused_"))


@dataclass(frozen=True, kw_only=True)
class StageProgress(Progress):
    """A stage server's record: its queue, its server's rates and caches, the outer step's round (and counters)."""

    role: ClassVar[str] = "stage"

    stage: int  # the stage it serves
    queue: int = 0  # requests waiting for the compute thread
    refused: int = 0  # requests answered with an error
    inner_steps: int = 0  # the stage's inner steps taken
    samples_per_s: float = 0.0  # samples served per second (0: no update yet)
    grad_norm: float = 0.0  # gradient norm at the last inner step, before clipping
    skipped_steps: int = 0  # inner steps skipped for a non-finite gradient norm
    cached: int = 0  # forwards whose inputs it holds for their backward
    first_served_at: float | None = None  # unix time of its first forward served (None: none yet)
    evicted: int = 0  # cached inputs evicted (their trainers resend them)
    from_stage: Mapping[str, int] = field(default_factory=dict)  # requests by the stage their input came from
    busy_fraction: float | None = None  # of the recent window, the fraction of time computing
    busy_fraction_total: float | None = None  # the same since the first request
    graphs: Mapping[str, float] = field(default_factory=dict)  # forward graphs kept: mb, budget_mb, released
    time_split: Mapping[str, Mapping[str, float]] = field(default_factory=dict)  # median seconds per request, by part


@dataclass(frozen=True, kw_only=True)
class FullProgress(Training):
    """A full peer's record: a trainer's training fields, the outer counters summed over its stages, and with
    ``--serve`` what it served."""

    role: ClassVar[str] = "full"

    outer_rounds: Mapping[str, int] = field(default_factory=dict)  # per stage (as a string): its outer round
    # with --serve, per stage 1..S served (as a string): "backward" (microbatches served) and "inner_steps"
    served: Mapping[str, Mapping[str, int]] | None = _optional()


ROLES: dict[str, type[Progress]] = {kind.role: kind for kind in (TrainerProgress, StageProgress, FullProgress)}


def _progress_fields(kind: type[Progress]) -> tuple[dataclasses.Field[Any], ...]:
    return tuple(f for f in dataclasses.fields(kind) if f.name not in ("stamp", "counters"))
