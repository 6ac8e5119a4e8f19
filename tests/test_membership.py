"""Membership: record schemas and signatures, config publication and mismatch errors, on a real loopback DHT."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import pickle
import re
from collections.abc import Iterator

import pydantic.v1 as pydantic
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from peer.data import load_corpus
from swarm.config import SwarmConfig
from swarm.config_toml import dumps_config
from swarm.dht.identity import (
    OwnerBindingValidator,
    identity_peer_id,
    peer_from_subkey,
)
from swarm.dht.membership import (
    ConfigRecord,
    Membership,
    MembershipError,
    StageStatus,
    check_access,
    config_validator,
    parse_config_record,
    pick_stage,
    reconcile_config,
    round_key,
    stage_key,
    stage_validator,
)
from swarm.dht.process import SwarmDHT
from swarm.dht.records import MAX_VERDICTS, PROTOCOL_VERSION, verdicts
from swarm.model.transformer import ModelConfig
from swarm.node.config import PeerConfig
from swarm.pipeline.trainer import Batch
from swarm.rpc.auth import encode_public_key
from swarmtest.attacks import forge_replicas, modified_peer, stored_subkeys
from swarmtest.configs import DATA, FAST_TIMEOUTS, LOOPBACK_MADDRS, tiny_config
from swarmtest.node import BackgroundNode

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


def signed_subkey(key: RSAPrivateKey, peer_id: str | None = None) -> bytes:
    """A record subkey naming ``peer_id`` (default: the key's own) beside ``key``'s owner marker, as a peer writes it."""
    return (peer_id or identity_peer_id(key)).encode() + RSASignatureValidator(key).local_public_key


def test_the_peer_id_is_the_owner_keys_and_a_subkey_naming_another_is_refused() -> None:
    key, other = RSAPrivateKey(), RSAPrivateKey()
    mine = signed_subkey(key)
    assert peer_from_subkey(mine) == PeerID.from_base58(identity_peer_id(key))
    owner = RSASignatureValidator(key).local_public_key
    forged = [
        signed_subkey(key, identity_peer_id(other)),  # someone else's id beside my key
        signed_subkey(key, PEER.to_base58()),  # a made-up id
        PEER.to_base58().encode() + OWNER,  # an id beside a key that is no key
        owner,  # no id
        identity_peer_id(key).encode(),  # no key
        b"\xff\xfe" + owner,
        mine[:-1],  # the marker not closed
    ]
    for bad in forged:
        assert peer_from_subkey(bad) is None, bad
    binding, key_name = OwnerBindingValidator(), stage_key(CFG.swarm_id, 1)
    value = StageStatus().dict()
    assert binding.validate(record(key_name, mine, value))
    assert binding.validate(record(key_name, b"no marker: other validators decide", value))
    for bad in forged[:4]:
        assert not binding.validate(record(key_name, bad, value)), bad
    assert not binding.validate(record(key_name, b"[owner:" + b"\xc1" * 8, value))  # not msgpack
    assert pickle.loads(pickle.dumps(binding)).merge_with(binding)  # one per DHT process


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


def test_the_record_carries_at_most_sixteen_verdicts_the_dht_validator_checks_them() -> None:
    base58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZ"
    bans = {f"peer{base58[i]}": 1000.0 + i for i in range(MAX_VERDICTS + 4)} | {"ended": 5.0, "0bad": 2000.0}
    field = verdicts(bans, now=10.0, dht_now=1e9)  # a trainer's checker clock, and the DHT's
    assert len(field) == MAX_VERDICTS and "ended" not in field and "0bad" not in field  # "0": no base58 peer id
    assert min(field.values()) == 1e9 + 1000.0 + 4 - 10.0  # the bans that end last are kept, in DHT time
    validator, key = stage_validator(CFG), stage_key(CFG.swarm_id, 0)
    subkey = PEER.to_base58().encode() + OWNER
    assert validator.validate(record(key, subkey, StageStatus(condemned=field).dict()))
    too_many = {**field, "Zpeer": 1e9}
    with pytest.raises(pydantic.ValidationError):
        StageStatus(condemned=too_many)
    assert not validator.validate(record(key, subkey, {**StageStatus().dict(), "condemned": too_many}))
    assert not validator.validate(record(key, subkey, {**StageStatus().dict(), "condemned": {"0x": 1.0}}))


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


def test_a_private_swarm_admits_only_its_own_authoritys_peers() -> None:
    mine, theirs = (encode_public_key(Ed25519PrivateKey.generate().public_key()) for _ in range(2))
    private = SwarmConfig(name="demo", authority=mine)
    check_access(private, mine)
    for authority in (None, mine, theirs):
        check_access(CFG, authority)  # a public config (or one written before configs named authorities)
    with pytest.raises(MembershipError, match=f"swarm {private.swarm_id} is private.*--credentials"):
        check_access(private, None)
    with pytest.raises(
        MembershipError, match=re.escape(f"comes from authority {theirs}, but swarm {private.swarm_id} is run by")
    ):
        check_access(private, theirs)


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
def two_dhts() -> Iterator[tuple[SwarmDHT, SwarmDHT]]:
    first = SwarmDHT(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    second = SwarmDHT(initial_peers=[str(m) for m in first.get_visible_maddrs()], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    yield first, second
    second.shutdown()
    first.shutdown()


@pytest.mark.timeout(60)
def test_config_is_fetched_checked_and_records_are_signed(two_dhts: tuple[SwarmDHT, SwarmDHT]) -> None:
    asyncio.run(_membership_over_dht(*two_dhts))


@pytest.mark.timeout(60)
def test_records_of_another_protocol_version_are_ignored_and_said_so_once(
    two_dhts: tuple[SwarmDHT, SwarmDHT], caplog: pytest.LogCaptureFixture
) -> None:
    first, second = two_dhts

    async def scenario() -> None:
        creator, reader = Membership(first), Membership(second)
        await creator.join(CFG, create=True)
        await reader.join(None, create=False, name=CFG.name, fetch_timeout_s=5)
        old_release = {**StageStatus(samples_per_s=1.0).dict(), "version": PROTOCOL_VERSION - 1}
        await first.store(
            stage_key(CFG.swarm_id, 2), old_release, get_dht_time() + 60, subkey=creator.subkey, return_future=True
        )
        with caplog.at_level(logging.WARNING, logger="swarm.dht.membership"):
            assert await reader.replicas(2) == {}  # invisible, as before
            assert await reader.replicas(2) == {}
        said = [r.getMessage() for r in caplog.records if "protocol version" in r.getMessage()]
        assert len(said) == 1 and f"version {PROTOCOL_VERSION - 1} (this peer speaks {PROTOCOL_VERSION})" in said[0]

    asyncio.run(scenario())


async def _membership_over_dht(first: SwarmDHT, second: SwarmDHT) -> None:
    creator, joiner = Membership(first), Membership(second)
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

    # a trainer's verdicts travel in its stage-0 record, signed by it
    verdict = {first.peer_id.to_base58(): get_dht_time() + 600.0}
    await joiner.announce(0, StageStatus(condemned=verdict))
    assert (await creator.replicas(0))[second.peer_id].condemned == verdict
    await joiner.retire(0)

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
        await first.store(
            key, {**forged, "version": PROTOCOL_VERSION}, now + 32, subkey=creator.subkey, return_future=True
        )
        assert await joiner.round_declarations(1, 3) == {first.peer_id: now}  # no honest node took the record
        found = await second.get(key, latest=True, return_future=True)
        assert found.value[creator.subkey].value == {"round": 3, "opened_at": now, "version": PROTOCOL_VERSION}


def corpus_batches(cfg: SwarmConfig, peer_id: str) -> tuple[Iterator[Batch], list[Batch]]:
    corpus = load_corpus([DATA])
    kw = dict(batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len)
    return corpus.sample_batches("train", seed=1, **kw), corpus.val_batches(num_sequences=kw["batch_size"], **kw)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_stage_records_under_made_up_peer_ids_are_refused_and_never_routed_to() -> None:
    cfg = tiny_config(stages=1, steps=200, outer={"method": "none"}, timeouts=FAST_TIMEOUTS)
    key = stage_key(cfg.swarm_id, 1)
    with BackgroundNode(PeerConfig(role="stage", stage=1, name="stage1-a", host_maddrs=LOOPBACK_MADDRS), cfg) as server:
        honest = server.call(lambda node: asyncio.sleep(0, node.dht.peer_id))
        attacker, signer = modified_peer(server.maddrs)
        try:
            forged = asyncio.run(forge_replicas(attacker, signer, key, honest))
            assert len(forged) == 4, "the forged records are in the DHT: a reader that trusts subkeys sees them"
            trainer = PeerConfig(
                role="trainer", name="trainer", initial_peers=server.maddrs, host_maddrs=LOOPBACK_MADDRS, steps=8
            )
            with BackgroundNode(trainer, data=corpus_batches) as peer:
                for node in (server, peer):  # neither the schema-checked DHT nor the reader lets them in
                    assert not forged & node.call(lambda n: stored_subkeys(n.dht, key)), node.config.name
                    assert set(node.call(lambda n: n.membership.replicas(1))) == {honest}
                last = peer.result(timeout=180)
        finally:
            attacker.shutdown()
    assert last["step"] == 8 and last["failed"] == 0
    assert last["hop_failures"] == 0 and last["skipped_hops"] == 0, "routing picked a forged replica"
