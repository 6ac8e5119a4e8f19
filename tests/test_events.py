"""The typed events (swarm/events/): each kind's JSONL line is the dict literal's line of before, and reads back."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from swarm.dht.records import PeerMetrics
from swarm.events import (
    KINDS,
    Event,
    Fault,
    FullProgress,
    Metrics,
    Move,
    OuterDeclared,
    OuterRound,
    OuterStrike,
    PipelineCounts,
    Progress,
    Recovered,
    Revocations,
    Rollback,
    ServesStages,
    Serving,
    Spawned,
    StageCheckpoint,
    StageProgress,
    Stamp,
    StateDownload,
    StateServed,
    TrainerProgress,
    UnknownEvent,
    parse_event,
)
from swarm.events.progress import ROLES
from swarm.pipeline.trainer import COUNTERS

METRICS = PeerMetrics(role="stage", stage=1, state="serving", step=3, tokens=100, bytes_sent={"act": 5}, version=6)
SOURCE = {"stage": 0, "peer": "abc", "vouched_by": 2, "sha256": "00ff", "weights_hash": "12", "grad_norm": 0.5}

# a progress record of each role, and its line's keys (as each role's dict literal wrote them, sorted by field)
TRAINING_LINE = {"step": 5, "tokens": 640, "train_loss": 4.5, "tokens_per_s": 64.0, "lr": 0.001, "grad_norm": 0.5}


def evaluated(line: dict[str, Any], val_loss: float) -> dict[str, Any]:
    """A training line with ``val_loss`` in its place (after ``train_loss``)."""
    at = list(line).index("train_loss") + 1
    return dict([*list(line.items())[:at], ("val_loss", val_loss), *list(line.items())[at:]])


PIPELINE = {name: 0 for name in COUNTERS} | {"started": 9, "completed": 7, "failed": 1, "skipped_hops": 2}
TRAINER_LINE = {
    "elapsed_s": 10.0,
    **TRAINING_LINE,
    "window": 2,
    "round_trip_s": 0.5,
    "microbatches_per_s": None,
    "staleness_mean": 0.5,
    "staleness_max": 1,
    **PIPELINE,
    "wire_bytes": {"activations": 10},
    "fp32_bytes": {"activations": 40},
    "frames_sent": {"int8": 3},
    "links": {"QmA": {"activations": "int8"}},
    "condemned": ["QmBad"],
    "hop_refused_busy": 2,
}
TRAINER = TrainerProgress(
    elapsed_s=10.0,
    **TRAINING_LINE,  # type: ignore[arg-type]
    window=2,
    round_trip_s=0.5,
    staleness_mean=0.5,
    staleness_max=1,
    pipeline=PipelineCounts(started=9, completed=7, failed=1, skipped_hops=2),
    wire_bytes={"activations": 10},
    fp32_bytes={"activations": 40},
    frames_sent={"int8": 3},
    links={"QmA": {"activations": "int8"}},
    condemned=("QmBad",),
    counters={"hop_refused_busy": 2},
)
OUTER_COUNTERS = {"outer_done": 2, "pseudo_grad_bytes": 100, "pseudo_grad_fp32_bytes": 400}
STAGE_LINE = {
    "elapsed_s": 3.0,
    "outer_round": 1,
    "global_hash": "beef",
    "stage": 1,
    "queue": 0,
    "refused": 1,
    "inner_steps": 4,
    "samples_per_s": 2.5,
    "grad_norm": 0.25,
    "skipped_steps": 0,
    "cached": 2,
    "first_served_at": None,
    "evicted": 0,
    "from_stage": {"0": 8},
    "busy_fraction": 0.5,
    "busy_fraction_total": None,
    "graphs": {"mb": 1.0, "budget_mb": 8.0, "released": 0},
    "time_split": {"backward": {"compute": 0.01}},
    "forward": 8,
    "backward": 8,
    "outer_done": 1,
}
STAGE = StageProgress.from_json({"role": "stage", **STAGE_LINE})
FULL_LINE = {"elapsed_s": 4.0, **TRAINING_LINE, "outer_rounds": {"0": 1, "1": 1}}
FULL = FullProgress(
    elapsed_s=4.0,
    **TRAINING_LINE,  # type: ignore[arg-type]
    outer_rounds={"0": 1, "1": 1},
    counters={"outer_done": 2},
)

# (the event, the dict literal its emitter logged before the types), every kind and every emitter's variant
SAMPLES: list[tuple[Event, dict[str, Any]]] = [
    (Metrics(metrics=METRICS.dict()), {"event": "metrics", "metrics": METRICS.dict()}),
    (
        Fault(peer="s-1", step=4, stage=1, action="kill"),
        {"event": "fault", "peer": "s-1", "step": 4, "stage": 1, "action": "kill"},
    ),
    (
        Revocations(sequence=3, revoked=2, source="dht"),
        {"event": "revocations", "sequence": 3, "revoked": 2, "source": "dht"},
    ),
    (
        Move(from_stage=1, to_stage=2, downloaded=True, rebuilt=False),
        {"event": "move", "from": 1, "to": 2, "downloaded": True, "rebuilt": False},
    ),
    (
        Rollback(stage=1, schedule_step=40, path="/tmp/s1.pt"),
        {"event": "rollback", "stage": 1, "schedule_step": 40, "path": "/tmp/s1.pt"},
    ),
    (  # outer/replica.py: a catch-up download
        StateDownload(
            stage=1,
            from_peer="QmPeer",
            reason="behind",
            vouched_by=2,
            download_s=0.25,
            outer_round=3,
            global_hash="beef",
        ),
        {
            "event": "state_download",
            "stage": 1,
            "from": "QmPeer",
            "reason": "behind",
            "vouched_by": 2,
            "download_s": 0.25,
            "outer_round": 3,
            "global_hash": "beef",
        },
    ),
    (  # full peer: the states it joined with
        StateDownload(stage=2, reason="join", outer_round=1),
        {"event": "state_download", "stage": 2, "reason": "join", "outer_round": 1},
    ),
    (
        StateServed(stage=1, sha256="0123456789abcdef"),
        {"event": "state_served", "stage": 1, "sha256": "0123456789abcdef"},
    ),
    (
        Serving(stage=1, outer_round=0, global_hash="beef"),
        {"event": "serving", "stage": 1, "outer_round": 0, "global_hash": "beef"},
    ),
    (ServesStages(stages=(1, 2)), {"event": "serves_stages", "stages": [1, 2]}),
    (
        Recovered(
            stage=1,
            kind="merge",
            sources=(SOURCE, SOURCE | {"stage": 2}),
            weights_hash="12",
            rebuild_s=1.5,
            installed_hash="12",
            lr_scale=0.5,
            saved=None,
        ),
        {
            "event": "recovered",
            "stage": 1,
            "kind": "merge",
            "sources": [SOURCE, SOURCE | {"stage": 2}],
            "weights_hash": "12",
            "rebuild_s": 1.5,
            "installed_hash": "12",
            "lr_scale": 0.5,
            "saved": None,
        },
    ),
    (  # a trainer's, at its end
        StageCheckpoint(stage=0, path="/tmp/s0.pt"),
        {"event": "stage_checkpoint", "stage": 0, "path": "/tmp/s0.pt"},
    ),
    (  # a stage server's, every checkpoint_every steps
        StageCheckpoint(stage=1, inner_steps=20, path="/tmp/s1.pt"),
        {"event": "stage_checkpoint", "stage": 1, "inner_steps": 20, "path": "/tmp/s1.pt"},
    ),
    (
        OuterDeclared(stage=0, round=2, opened_at=12.5),
        {"event": "outer_declared", "stage": 0, "round": 2, "opened_at": 12.5},
    ),
    (
        OuterRound(
            stage=0,
            round=2,
            outcome="done",
            reason=None,
            group=3,
            contributors=2,
            contributor_ids=("a", "b"),
            leader="a",
            outer_round=3,
            global_hash="beef",
            round_s=0.5,
            received_bytes=1024,
            dropped=(),
            clipped=("b",),
            bounded=("a",),
        ),
        {
            "event": "outer_round",
            "stage": 0,
            "round": 2,
            "outcome": "done",
            "reason": None,
            "group": 3,
            "contributors": 2,
            "contributor_ids": ["a", "b"],
            "leader": "a",
            "outer_round": 3,
            "global_hash": "beef",
            "round_s": 0.5,
            "received_bytes": 1024,
            "dropped": [],
            "clipped": ["b"],
            "bounded": ["a"],
        },
    ),
    (
        OuterStrike(stage=1, peer="QmBad", reason="its Δ was dropped", banned=True),
        {"event": "outer_strike", "stage": 1, "peer": "QmBad", "reason": "its Δ was dropped", "banned": True},
    ),
    (TRAINER, {"role": "trainer", **TRAINER_LINE}),
    (  # the outer step's part added (TrainerRole) and an evaluation
        dataclasses.replace(
            TRAINER, val_loss=4.25, outer_round=3, global_hash="beef", counters=TRAINER.counters | OUTER_COUNTERS
        ),
        {
            "role": "trainer",
            "elapsed_s": 10.0,
            "outer_round": 3,
            "global_hash": "beef",
            **evaluated(TRAINING_LINE, 4.25),
            **TRAINER_LINE,
            **OUTER_COUNTERS,
        },
    ),
    (STAGE, {"role": "stage", **STAGE_LINE}),
    (FULL, {"role": "full", **FULL_LINE, "outer_done": 2}),
    (  # with --serve, evaluated
        dataclasses.replace(FULL, val_loss=4.0, served={"1": {"backward": 7, "inner_steps": 2}}),
        {
            "role": "full",
            "elapsed_s": 4.0,
            **evaluated(TRAINING_LINE, 4.0),
            **FULL_LINE,
            "served": {"1": {"backward": 7, "inner_steps": 2}},
            "outer_done": 2,
        },
    ),
]


def logged_before(record: dict[str, Any], *, gpu: bool) -> str:
    """A line as ``peer/launch.py``'s writer wrote a dict record before the types."""
    stamped = {"time": 17.0, "peer": "s-1", **record, "peak_rss_mb": 512.5}
    return json.dumps(stamped | ({"peak_gpu_mb": 80.0} if gpu else {}))


def test_every_kind_has_a_sample() -> None:
    assert {type(event) for event, _ in SAMPLES} == set(KINDS.values()) - {Spawned} | set(ROLES.values())


@pytest.mark.parametrize("gpu", [False, True])
@pytest.mark.parametrize(("event", "record"), SAMPLES, ids=lambda x: type(x).__name__ if isinstance(x, Event) else "")
def test_the_line_is_the_one_of_before_and_reads_back(event: Event, record: dict[str, Any], gpu: bool) -> None:
    assert event.to_record() == record  # unstamped: what an in-process harness gets
    stamp = Stamp(time=17.0, peer="s-1", peak_rss_mb=512.5, peak_gpu_mb=80.0 if gpu else None)
    line = json.dumps(event.stamped(stamp).to_record())
    assert line == logged_before(record, gpu=gpu)
    read = parse_event(json.loads(line))
    assert type(read) is type(event) and read.to_record() == json.loads(line)
    # a peer field of the event's own keeps the key (the logging peer's name is not in the line, as before)
    own_peer = isinstance(event, (Fault, OuterStrike))
    assert read == event.stamped(stamp if not own_peer else Stamp(**(vars(stamp) | {"peer": None})))


def test_a_join_download_with_its_time_reads_back() -> None:
    """A stage server's join download (``download_s`` after ``outer_round`` in its dict literal): the same record,
    the keys in the field order."""
    before = {"event": "state_download", "stage": 1, "reason": "join", "outer_round": 2, "download_s": 0.5}
    event = StateDownload(stage=1, reason="join", outer_round=2, download_s=0.5)
    assert event.to_record() == before and parse_event(before) == event


def test_spawned_is_the_launchers_line() -> None:
    line = json.dumps({"time": 3.0, "peer": "trainer-0", "event": "spawned"})
    event = parse_event(json.loads(line))
    assert event == Spawned(stamp=Stamp(time=3.0, peer="trainer-0"))
    assert json.dumps(event.to_record()) == line


def test_a_record_without_event_is_its_roles_progress() -> None:
    line = {
        "time": 1.0,
        "peer": "s-1",
        "role": "stage",
        "stage": 1,
        "elapsed_s": 2.0,
        "backward": 3,
        "peak_rss_mb": 10.0,
    }
    event = parse_event(line)
    assert isinstance(event, StageProgress) and event.stage == 1 and event.queue == 0
    assert event.count("backward") == 3 and event.count("forward") == 0 and event.counters == {"backward": 3}
    assert event["stage"] == 1 and "backward" in event and event.get("nope") is None  # a script's dict reading
    assert event.stamp == Stamp(time=1.0, peer="s-1", peak_rss_mb=10.0) and event.time == 1.0
    assert StageProgress.from_json(line) == Progress.from_json(line) == event
    with pytest.raises(ValueError, match="unstamped StageProgress"):
        _ = STAGE.time
    with pytest.raises(UnknownEvent, match="role 'auditor'"):
        parse_event({"role": "auditor", "elapsed_s": 1.0})
    with pytest.raises(UnknownEvent, match="without the fields"):
        parse_event({"role": "stage", "elapsed_s": 1.0})  # no stage
    with pytest.raises(UnknownEvent, match="a TrainerProgress of role 'stage'"):
        TrainerProgress.from_json(line)


def test_a_trainers_counters_are_the_trainers() -> None:
    assert tuple(f.name for f in dataclasses.fields(PipelineCounts)) == COUNTERS
    assert TRAINER.pipeline.in_flight == 1 and TRAINER.refused_hops() == 2


def test_metrics_read_back_as_the_record() -> None:
    event = parse_event(json.loads(json.dumps(Metrics(metrics=METRICS.dict()).to_record())))
    assert isinstance(event, Metrics) and PeerMetrics.parse_obj(event.metrics) == METRICS


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"event": "teleport", "stage": 1}, "unknown event 'teleport'"),
        ({"event": "serving", "stage": 1, "outer_round": 0, "global_hash": "x", "colour": "red"}, "colour"),
        ({"event": "serving", "stage": 1}, "without the fields of Serving"),
    ],
)
def test_a_record_no_kind_fits_is_refused(record: dict[str, Any], match: str) -> None:
    with pytest.raises(UnknownEvent, match=match):
        parse_event(record)
