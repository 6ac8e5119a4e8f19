"""Peer metrics: the record's schema in the DHT, rates and losses, byte counting, and a round trip through a real DHT."""

from __future__ import annotations

import asyncio
import math
import pickle
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hypothesis import given, settings
from hypothesis import strategies as st

from swarm.config import SwarmConfig
from swarm.dht.membership import Membership, metrics_key, stage_validator
from swarm.dht.metrics import Meter, Traffic
from swarm.dht.process import SwarmDHT
from swarm.dht.records import MAX_KINDS, PROTOCOL_VERSION, STATES, PeerMetrics, RecoveryClaim, StageStatus
from swarm.events import FullProgress, TrainerProgress
from swarm.node.lifecycle import publish_metrics
from swarm.pipeline.metering import MeteredBackend
from swarm.pipeline.protocol import Backward, Forward
from swarmtest.clock import FakeClock
from swarmtest.fakes import EchoBackend

CFG = SwarmConfig()
SUBKEY = b"12D3KooWPcjMuJ8nWHAyKLEq62rjpDURMtaXdxPyBdXn9iJs2QaG[owner:ssh-rsa AAAAB3NzaC1yc2E]"
GOOD = PeerMetrics(
    role="trainer",
    stage=0,
    state="training",
    step=12,
    train_loss=3.5,
    val_loss=3.7,
    tokens_per_s=812.5,
    name="trainer-0",
    tokens=40_000,
    uptime_s=50.5,
    device="cuda:0 (NVIDIA H100 80GB HBM3)",
    bytes_sent={"activations": 1000, "gradients": 900},
    bytes_received={"activations": 1000},
    frames_sent={"int8": 3, "subspace+int4": 1},
    version=PROTOCOL_VERSION,
).dict()


def stored(value: object, subkey: bytes = SUBKEY) -> DHTRecord:
    """The metrics record as a storing DHT node sees it: key hashed, subkey and value serialized."""
    dumps = DHTProtocol.serializer.dumps
    return DHTRecord(
        key=DHTID.generate(source=metrics_key(CFG.swarm_id)).to_bytes(),
        subkey=dumps(subkey),
        value=dumps(value),
        expiration_time=get_dht_time() + 10,
    )


@pytest.mark.parametrize(
    "validator_for",
    [lambda: stage_validator(CFG), lambda: pickle.loads(pickle.dumps(stage_validator(CFG)))],
    ids=["built", "unpickled in the DHT process"],
)
def test_metrics_records_must_match_the_schema(validator_for) -> None:
    validator = validator_for()
    assert validator.validate(stored(GOOD))
    assert validator.validate(stored(None))  # retired
    too_many = {f"kind{i}": 1 for i in range(MAX_KINDS + 1)}
    for field, bad in [
        ("role", "boss"),
        ("state", "asleep"),
        ("step", -1),
        ("step", 1.0),
        ("stage", True),
        ("tokens_per_s", 3),
        ("train_loss", math.nan),
        ("val_loss", -1.0),
        ("bytes_sent", {"Not A Kind": 1}),
        ("bytes_sent", {"activations": -1}),
        ("bytes_received", {"activations": 1.0}),
        ("bytes_received", too_many),
        ("version", "1"),
        ("name", "with space"),
        ("name", "x" * 65),
        ("name", "-leading-dash"),
        ("tokens", -1),
        ("uptime_s", math.inf),
        ("device", "<script>"),
        ("device", "x" * 81),
        ("frames_sent", {"<b>int8</b>": 1}),
        ("frames_sent", {"int8": -1}),
        ("frames_sent", {f"codec{i}": 1 for i in range(MAX_KINDS + 1)}),
    ]:
        assert not validator.validate(stored({**GOOD, field: bad})), (field, bad)
    assert not validator.validate(stored({**GOOD, "extra": 1}))
    old = {
        key: value for key, value in GOOD.items() if key not in ("name", "tokens", "uptime_s", "device", "frames_sent")
    }
    assert validator.validate(stored(old))  # a record from before these fields is still valid
    assert not validator.validate(stored(GOOD, subkey=b"no owner marker"))


finite = st.floats(min_value=0.0, max_value=1e6, allow_nan=False)
counts = st.dictionaries(
    st.from_regex(r"[a-z][a-z0-9_]{0,31}", fullmatch=True), st.integers(0, 2**62), max_size=MAX_KINDS
)


@settings(deadline=None, max_examples=60)
@given(
    role=st.sampled_from(["trainer", "stage"]),
    stage=st.integers(0, 64),
    state=st.sampled_from(STATES),
    step=st.integers(0, 2**40),
    train_loss=st.none() | finite,
    val_loss=st.none() | finite,
    tokens_per_s=finite,
    sent=counts,
    received=counts,
    counters=st.tuples(st.integers(0, 2**31), st.integers(0, 2**31), st.integers(0, 2**31)),
)
def test_every_record_a_peer_can_build_is_accepted_unchanged(
    role, stage, state, step, train_loss, val_loss, tokens_per_s, sent, received, counters
) -> None:
    outer_round, recoveries, bans = counters
    metrics = PeerMetrics(
        role=role,
        stage=stage,
        state=state,
        step=step,
        train_loss=train_loss,
        val_loss=val_loss,
        tokens_per_s=tokens_per_s,
        bytes_sent=sent,
        bytes_received=received,
        outer_round=outer_round,
        recoveries=recoveries,
        bans=bans,
        dht_stores=recoveries + bans,
        version=PROTOCOL_VERSION,
    )
    assert stage_validator(CFG).validate(stored(metrics.dict()))
    assert PeerMetrics.parse_obj(DHTProtocol.serializer.loads(DHTProtocol.serializer.dumps(metrics.dict()))) == metrics


TRAINED = {"step": 0, "tokens": 0, "elapsed_s": 1.0, "tokens_per_s": 0.0, "lr": 1e-3, "grad_norm": 0.0}


def trainer_record(**fields: Any) -> TrainerProgress:
    return TrainerProgress(**(TRAINED | fields))


def full_record(**fields: Any) -> FullProgress:
    return FullProgress(**(TRAINED | fields))


def test_meter_turns_a_running_token_count_into_a_rate_and_keeps_the_last_losses() -> None:
    clock = FakeClock(100.0)
    meter = Meter(role="trainer", stage=0, state="joining", name="alice", device="cpu", clock=clock)
    status = StageStatus(inner_steps=7, outer_round=2)
    clock.advance(2.0)
    first = meter.sample(status, tokens=1000, bans=1)
    assert (first.tokens_per_s, first.step, first.outer_round, first.bans, first.train_loss) == (500.0, 7, 2, 1, None)
    meter.observe(full_record(train_loss=3.25, step=10))
    meter.observe(full_record(train_loss=3.0, val_loss=3.5))
    # no new loss; a diverged validation is not published
    meter.observe(full_record(train_loss=None, val_loss=math.nan))
    meter.state, meter.traffic.sent["activations"] = "training", 4096
    clock.advance(4.0)
    second = meter.sample(status, tokens=1000 + 2 * 4000)
    assert (second.tokens_per_s, second.train_loss, second.val_loss, second.state) == (2000.0, 3.0, None, "training")
    assert (second.tokens, second.uptime_s, second.name, second.device) == (9000, 6.0, "alice", "cpu")
    assert second.bytes_sent == {"activations": 4096} and meter.last == second
    assert stage_validator(CFG).validate(stored(second.dict()))


def test_meter_publishes_a_trainers_window_and_staleness_from_its_progress_record() -> None:
    meter = Meter(role="trainer", stage=0, state="training")
    status = StageStatus(inner_steps=7)
    assert (meter.sample(status, tokens=0).window, meter.last.staleness_max) == (None, None)  # nothing logged yet
    meter.observe(trainer_record(train_loss=3.0, window=3, staleness_mean=1.5, staleness_max=2))
    record = meter.sample(status, tokens=0)
    assert (record.window, record.staleness_mean, record.staleness_max) == (3, 1.5, 2)
    assert stage_validator(CFG).validate(stored(record.dict()))
    meter.observe(trainer_record(train_loss=3.0, window=4))  # none landed
    assert (meter.sample(status, tokens=0).window, meter.last.staleness_mean) == (4, None)


def test_a_server_counts_requests_as_received_and_replies_as_sent_by_kind() -> None:
    server, compute = Traffic(), EchoBackend(reply_bytes=300, info={"forward": 1})
    backend = MeteredBackend(compute, server)
    peer = PeerID(b"trainer")

    async def session() -> None:
        await backend.forward(peer, Forward(mb="a", stage=1, prev_stage=0, x=bytes(100)))
        await backend.forward(peer, Forward(mb="e", stage=1, prev_stage=0, x=bytes(50), train=False))
        await backend.backward(peer, Backward(mb="a", stage=1, grad=bytes(70)))
        await backend.backward(peer, Backward(mb="a", stage=1, grad=bytes(70), x=bytes(100)))  # input resent
        compute.fail = ConnectionError("gone")
        with pytest.raises(ConnectionError):
            await backend.forward(peer, Forward(mb="b", stage=1, prev_stage=0, x=bytes(100)))

    asyncio.run(session())
    assert server.received == {"activations": 300, "eval": 50, "gradients": 140}  # a failed call's request came in
    assert server.sent == {"activations": 300, "eval": 300, "gradients": 600}  # its reply never went out
    assert backend.info() == {"forward": 1}


@pytest.fixture(scope="module")
def peer_and_client() -> Iterator[tuple[SwarmDHT, SwarmDHT]]:
    """A peer's DHT node and a client-mode node joined through it, as the dashboard's."""
    peer = SwarmDHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = SwarmDHT(
        initial_peers=[str(m) for m in peer.get_visible_maddrs()],
        client_mode=True,
        host_maddrs=["/ip4/127.0.0.1/tcp/0"],
    )
    yield peer, client
    client.shutdown()
    peer.shutdown()


@pytest.mark.timeout(60)
def test_metrics_are_read_back_signed_and_retired(peer_and_client: tuple[SwarmDHT, SwarmDHT]) -> None:
    asyncio.run(_round_trip(*peer_and_client))


async def _round_trip(peer_dht: SwarmDHT, client_dht: SwarmDHT) -> None:
    peer, client = Membership(peer_dht), Membership(client_dht)
    await peer.join(CFG, create=True)
    await client.join(None, create=False, name=CFG.name, fetch_timeout_s=5)
    metrics = PeerMetrics.parse_obj(GOOD)
    await peer.publish_metrics(metrics)
    assert await client.metrics() == {peer_dht.peer_id: metrics}

    key = metrics_key(CFG.swarm_id)
    await client_dht.store(
        key, {**GOOD, "train_loss": 0.01}, get_dht_time() + 60, subkey=peer.subkey, return_future=True
    )  # not the owner
    await peer_dht.store(
        key, {**GOOD, "step": -5}, get_dht_time() + 60, subkey=peer.subkey, return_future=True
    )  # signed, off-schema
    assert await client.metrics() == {peer_dht.peer_id: metrics}

    await peer.publish_metrics(None)
    assert await client.metrics() == {}


@pytest.mark.timeout(60)
def test_every_record_a_peer_stores_is_counted_and_the_count_published(
    peer_and_client: tuple[SwarmDHT, SwarmDHT],
) -> None:
    asyncio.run(_counted_stores(*peer_and_client))


async def _counted_stores(peer_dht: SwarmDHT, client_dht: SwarmDHT) -> None:
    peer, client = Membership(peer_dht), Membership(client_dht)
    await peer.join(CFG, create=True)
    await client.join(None, create=False, name=CFG.name, fetch_timeout_s=5)
    assert (peer.stores, client.stores) == (1, 1)  # each published the config
    now = get_dht_time()
    await peer.announce(1, StageStatus())
    await peer.declare_round(1, 0, opened_at=now, expiration=now + 10)
    await peer.claim_recovery(2, RecoveryClaim(priority=0, claimed_at=now), expiration=now + 10)
    await peer.withdraw_recovery(2)
    await peer.retire_all()
    assert peer.stores == 6 and client.stores == 1  # a peer counts its own stores, not what it reads
    metrics = Meter(role="stage", stage=1, state="serving").sample(StageStatus(), tokens=0, dht_stores=peer.stores)
    await peer.publish_metrics(metrics)
    assert peer.stores == 7
    assert (await client.metrics())[peer_dht.peer_id].dht_stores == 6  # the count when the record was made
    await peer.publish_metrics(None)
    assert peer.stores == 8


def test_a_peer_name_the_record_cannot_carry_is_refused_when_the_peer_is_configured() -> None:
    from swarm.errors import ConfigError
    from swarm.node.config import PeerConfig

    assert PeerConfig(name="trainer-0.lab_2").name == "trainer-0.lab_2"
    for bad in ("with space", "x" * 65, "-dash", "naïve", ""):
        with pytest.raises(ConfigError, match="letters, digits"):
            PeerConfig(name=bad)


def test_a_published_record_is_logged_as_it_is_published() -> None:
    """The JSONL file holds each metrics record the peer published (a ``metrics`` event), not a stale copy in its
    progress records."""
    published, logged = [], []

    async def publish(metrics: PeerMetrics) -> None:
        published.append(metrics)

    ctx = SimpleNamespace(membership=SimpleNamespace(publish_metrics=publish), on_log=logged.append)
    record = Meter(role="stage", stage=1, state="serving").sample(StageStatus(inner_steps=3), tokens=100)
    asyncio.run(publish_metrics(ctx, record))  # type: ignore[arg-type]  # a stand-in: what publish_metrics reads
    assert published == [record] and [event.to_record() for event in logged] == [
        {"event": "metrics", "metrics": record.dict()}
    ]
