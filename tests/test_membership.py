"""Membership: record schemas and signatures, config publication and mismatch errors, on a real loopback DHT."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import pickle
from collections.abc import Iterator

import pytest
from hivemind.dht import DHT
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from swarm.config import SwarmConfig, dumps_config
from swarm.dht.membership import (
    ConfigRecord,
    Membership,
    MembershipError,
    StageStatus,
    config_validator,
    parse_config_record,
    peer_from_subkey,
    pick_stage,
    reconcile_config,
    round_key,
    stage_key,
    stage_validator,
)
from swarm.model.transformer import ModelConfig

CFG = SwarmConfig()
OTHER = dataclasses.replace(CFG, model=ModelConfig(d_model=64))
PEER = PeerID.from_base58("12D3KooWPcjMuJ8nWHAyKLEq62rjpDURMtaXdxPyBdXn9iJs2QaG")
OWNER = b"[owner:ssh-rsa AAAAB3NzaC1yc2E]"


def record(raw_key: str, subkey: bytes, value: object) -> DHTRecord:
    """A DHT record as a storing node sees it: key hashed, subkey and value serialized."""
    dumps = DHTProtocol.serializer.dumps
    return DHTRecord(
        key=DHTID.generate(source=raw_key).to_bytes(),
        subkey=dumps(subkey),
        value=dumps(value),
        expiration_time=get_dht_time() + 10,
    )


def test_peer_id_is_read_back_from_the_subkey() -> None:
    assert peer_from_subkey(PEER.to_base58().encode() + OWNER) == PEER
    for bad in (OWNER, PEER.to_base58().encode(), b"not-a-peer-id" + OWNER, b"\xff\xfe" + OWNER):
        assert peer_from_subkey(bad) is None


@pytest.mark.parametrize(
    "validator_for",
    [lambda: stage_validator(CFG), lambda: pickle.loads(pickle.dumps(stage_validator(CFG)))],
    ids=["built", "unpickled in the DHT process"],
)
def test_stage_records_must_match_the_schema(validator_for) -> None:
    validator, key, subkey = validator_for(), stage_key(CFG.swarm_id, 2), PEER.to_base58().encode() + OWNER
    good = StageStatus(samples_per_s=12.5, queue=3, grad_norm=0.7).dict()
    assert validator.validate(record(key, subkey, good))
    assert validator.validate(record(key, subkey, None))  # a retired record
    for field, bad in [("queue", -1), ("queue", 1.0), ("samples_per_s", 3), ("grad_norm", math.inf), ("version", "1")]:
        assert not validator.validate(record(key, subkey, {**good, field: bad})), (field, bad)
    assert not validator.validate(record(key, subkey, {**good, "extra": 1}))
    assert not validator.validate(record(key, b"no owner marker", good))
    assert validator.validate(record("another/key", b"x", "anything"))  # other subsystems' keys pass through


def test_config_records_must_match_the_schema() -> None:
    validator, key = config_validator(CFG.name), f"{CFG.name}/config"
    good = ConfigRecord(hash=CFG.hash(), toml=dumps_config(CFG)).dict()
    assert validator.validate(record(key, OWNER, good))
    assert not validator.validate(record(key, OWNER, {**good, "hash": "XYZ"}))
    assert not validator.validate(record(key, OWNER, {**good, "toml": "x" * 100_000}))


def test_a_published_config_must_hash_to_what_it_claims() -> None:
    assert parse_config_record(ConfigRecord(hash=CFG.hash(), toml=dumps_config(CFG)).dict()) == CFG
    assert parse_config_record(ConfigRecord(hash=CFG.hash(), toml=dumps_config(OTHER)).dict()) is None
    assert parse_config_record({"hash": CFG.hash(), "toml": "not [toml"}) is None
    assert parse_config_record("junk") is None


def test_reconciling_configs() -> None:
    assert reconcile_config("swarmloco", None, [CFG]) == CFG  # fetched
    assert reconcile_config("swarmloco", CFG, [CFG, OTHER]) == CFG  # ours is among the published
    assert reconcile_config("swarmloco", OTHER, []) == OTHER  # nothing published yet: ours
    with pytest.raises(MembershipError, match=f"{CFG.hash()}.*{OTHER.hash()}"):
        reconcile_config("swarmloco", OTHER, [CFG])
    with pytest.raises(MembershipError, match="no swarm config is published under the name 'lost'"):
        reconcile_config("lost", None, [])
    with pytest.raises(MembershipError, match="several configs"):
        reconcile_config("swarmloco", None, [CFG, OTHER])


def test_new_servers_join_the_stage_with_fewest_replicas_then_least_throughput() -> None:
    status = lambda rate: StageStatus(samples_per_s=rate)
    replicas = {
        0: {"t": status(0.0)},
        1: {"a": status(9.0), "b": status(9.0)},
        2: {"c": status(50.0)},
        3: {"d": status(20.0)},
    }
    assert pick_stage(replicas) == 3
    assert pick_stage({**replicas, 4: {}}) == 4


@pytest.fixture(scope="module")
def two_dhts() -> Iterator[tuple[DHT, DHT]]:
    first = DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = DHT(
        initial_peers=[str(m) for m in first.get_visible_maddrs()], start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"]
    )
    yield first, second
    second.shutdown()
    first.shutdown()


@pytest.mark.timeout(60)
def test_config_is_fetched_checked_and_records_are_signed(two_dhts: tuple[DHT, DHT]) -> None:
    asyncio.run(_membership_over_dht(*two_dhts))


async def _membership_over_dht(first: DHT, second: DHT) -> None:
    creator, joiner = Membership(first, RSAPrivateKey()), Membership(second, RSAPrivateKey())
    assert await creator.join(CFG, create=True) == CFG
    with pytest.raises(
        MembershipError, match=f"runs config {CFG.hash()} but this peer's config hashes to {OTHER.hash()}"
    ):
        await joiner.join(OTHER, create=False, fetch_timeout_s=5)
    assert await joiner.join(None, create=False, name=CFG.name, fetch_timeout_s=5) == CFG

    await creator.announce(1, StageStatus(samples_per_s=5.0, queue=1))
    await joiner.announce(1, StageStatus(samples_per_s=7.0))
    replicas = await joiner.replicas(1)
    assert {peer: status.samples_per_s for peer, status in replicas.items()} == {
        first.peer_id: 5.0,
        second.peer_id: 7.0,
    }

    key = stage_key(CFG.swarm_id, 1)
    forged = StageStatus(samples_per_s=999.0).dict()
    await second.store(
        key, forged, get_dht_time() + 60, subkey=creator.subkey, return_future=True
    )  # not the owner: unsigned (newer, so it would win)
    await first.store(
        key, {"queue": -1}, get_dht_time() + 60, subkey=creator.subkey, return_future=True
    )  # signed, off-schema
    assert (await creator.replicas(1))[first.peer_id].samples_per_s == 5.0

    await joiner.retire(1)
    assert set(await creator.replicas(1)) == {first.peer_id}

    # outer-round declarations: one per peer and stage, the round in the record, checked by the DHT's schema
    now = get_dht_time()
    await creator.declare_round(1, 3, opened_at=now, expiration=now + 30)
    await joiner.declare_round(1, 3, opened_at=now + 1, expiration=now + 30)
    assert await creator.round_declarations(1, 3) == {first.peer_id: now, second.peer_id: now + 1}
    await joiner.declare_round(1, 4, opened_at=now + 2, expiration=now + 31)  # replaces its round-3 declaration
    assert await creator.round_declarations(1, 3) == {first.peer_id: now}
    assert await creator.round_declarations(1, 4) == {second.peer_id: now + 2}
    key = round_key(CFG.swarm_id, 1)
    for forged in (
        {"round": 3, "opened_at": 0.0},
        {"round": 3, "opened_at": now + 1e9},
        {"round": -1, "opened_at": now},
    ):
        # signed by the creator, newer than its declaration, but off-schema: a time no round can have, or no round
        await first.store(key, {**forged, "version": 1}, now + 32, subkey=creator.subkey, return_future=True)
        assert await joiner.round_declarations(1, 3) == {first.peer_id: now}  # no honest node took the record
        found = await second.get(key, latest=True, return_future=True)
        assert found.value[creator.subkey].value == {"round": 3, "opened_at": now, "version": 1}
