"""Swarm membership in the hivemind DHT: signed, schema-checked stage records and the swarm config.

``Membership`` joins a swarm (publishes, or fetches and checks, the config), announces and reads each stage's
records and the peers' metrics, and is the one signed store/read the other subsystems use (declarations,
claims, revocation lists). The keys, subkeys and validators: docs/architecture.md, dht/.

    >>> cfg = await Membership(dht).join(SwarmConfig(), create=True)  # or join(None, name=...)
"""

from __future__ import annotations

import asyncio
import logging
import tomllib
from types import GenericAlias
from typing import Any, TypeVar

import pydantic.v1 as pydantic
from hivemind.dht.schema import BytesWithPublicKey, RSASignatureValidator, SchemaValidator
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from swarm.config import SwarmConfig, config_from_dict
from swarm.config_toml import dumps_config
from swarm.dht.identity import peer_from_subkey
from swarm.dht.process import SwarmDHT
from swarm.dht.records import (
    PROTOCOL_VERSION,
    ConfigRecord,
    PeerMetrics,
    RecoveryClaim,
    RevocationRecord,
    RoundDeclaration,
    StageStatus,
    serving,
)
from swarm.errors import ConfigError

logger = logging.getLogger(__name__)


class MembershipError(RuntimeError):
    """This peer cannot join the swarm (no config published, or a different one)."""


def stage_key(swarm_id: str, stage: int) -> str:
    return f"{swarm_id}/stage/{stage}"


def config_key(name: str) -> str:
    return f"{name}/config"


def metrics_key(swarm_id: str) -> str:
    return f"{swarm_id}/metrics"


def round_key(swarm_id: str, stage: int) -> str:
    """Where the replicas of ``stage`` declare their arrival in an outer round (the round is in the record)."""
    return f"{swarm_id}/outer/{stage}"


def recovery_key(swarm_id: str, stage: int) -> str:
    return f"{swarm_id}/recovery/{stage}"


def revocations_key(swarm_id: str) -> str:
    return f"{swarm_id}/revocations"


RECORD_TYPES: dict[str, type[pydantic.BaseModel]] = {
    "stage": StageStatus,
    "config": ConfigRecord,
    "metrics": PeerMetrics,
    "claim": RecoveryClaim,
    "revocations": RevocationRecord,
    "round": RoundDeclaration,
}
# one per peer under a key, with a protocol version
PeerRecord = TypeVar("PeerRecord", StageStatus, PeerMetrics, RoundDeclaration, RecoveryClaim, RevocationRecord)


class _Records(pydantic.BaseModel):
    """The validator's schema: a parsed record reads back without the fields its sender left out, so hivemind's
    check that parsing changed nothing lets a record omit a field that was added later with a default."""

    def dict(self, **kwargs: Any) -> dict[str, Any]:
        return super().dict(**{**kwargs, "exclude_unset": True})  # nested records too


class SwarmSchemaValidator(SchemaValidator):
    """hivemind's SchemaValidator for keys known only at run time (they hold the swarm id).

    Built from ``{raw DHT key: record type name}``; each key holds a dict of signed subkey →
    record. It pickles as that dict, since the DHT process cannot import a class made at run time.
    """

    def __init__(self, keys: dict[str, str]) -> None:
        self.keys = dict(keys)
        # each key's value: dict[BytesWithPublicKey, its record type | None], a type made at run time
        fields: dict[str, Any] = {
            key: (GenericAlias(dict, (BytesWithPublicKey, RECORD_TYPES[kind] | None)), None)
            for key, kind in self.keys.items()
        }
        super().__init__(pydantic.create_model("SwarmRecords", __base__=_Records, **fields), allow_extra_keys=True)

    def __reduce__(self) -> tuple[type, tuple[dict[str, str]]]:
        return type(self), (self.keys,)


def config_validator(name: str) -> SwarmSchemaValidator:
    return SwarmSchemaValidator({config_key(name): "config"})


def stage_validator(cfg: SwarmConfig) -> SwarmSchemaValidator:
    """This swarm's stage records, outer-round declarations, recovery claims, metrics records and revocation lists."""
    stages = {stage_key(cfg.swarm_id, i): "stage" for i in range(cfg.stages.num_stages + 1)}
    rounds = {round_key(cfg.swarm_id, i): "round" for i in range(cfg.stages.num_stages + 1)}
    claims = {recovery_key(cfg.swarm_id, i): "claim" for i in range(1, cfg.stages.num_stages + 1)}
    others = {metrics_key(cfg.swarm_id): "metrics", revocations_key(cfg.swarm_id): "revocations"}
    return SwarmSchemaValidator({**stages, **rounds, **claims, **others})


def parse_config_record(value: object) -> SwarmConfig | None:
    """A published config whose TOML really hashes to the hash it claims, else None."""
    try:
        record = ConfigRecord.parse_obj(value)
        cfg = config_from_dict(tomllib.loads(record.toml))
    except (pydantic.ValidationError, tomllib.TOMLDecodeError, ConfigError, TypeError):
        return None
    return cfg if cfg.hash() == record.hash else None


def reconcile_config(name: str, local: SwarmConfig | None, published: list[SwarmConfig]) -> SwarmConfig:
    """The config this peer runs: the published one, checked against the local one if any."""
    hashes = sorted({cfg.hash() for cfg in published})
    if local is not None:
        if published and local.hash() not in hashes:
            raise MembershipError(
                f"swarm {name!r} runs config {', '.join(hashes)} but this peer's config hashes to {local.hash()}; "
                "join without --config to fetch the swarm's config, or use another swarm name"
            )
        return local
    if not hashes:
        raise MembershipError(
            f"no swarm config is published under the name {name!r}: pass the name the swarm runs under with --swarm "
            "NAME, or its swarm.toml with --config, or check --initial-peers"
        )
    if len(hashes) > 1:
        raise MembershipError(
            f"swarm {name!r} has several configs published ({', '.join(hashes)}); pass --config to pick one"
        )
    return next(cfg for cfg in published if cfg.hash() == hashes[0])


def check_access(cfg: SwarmConfig, authority: str | None) -> None:
    """MembershipError unless this peer's certificate authority (None: no credentials) is the one ``cfg`` names.

    A private swarm's config names its authority (and so does its id); a public config names none,
    and a config written before configs named authorities may still be run with credentials.
    """
    if not cfg.authority:
        return
    if authority is None:
        raise MembershipError(
            f"swarm {cfg.swarm_id} is private (authority {cfg.authority}): run with --identity and --credentials, "
            f"a certificate from its authority (`swarmloco swarm invite`)"
        )
    if authority != cfg.authority:
        raise MembershipError(
            f"this peer's certificate comes from authority {authority}, but swarm {cfg.swarm_id} is run by "
            f"authority {cfg.authority} (another swarm of the same name?): ask that authority for a certificate"
        )


class Membership:
    """One peer's view of the swarm in the DHT: its own records and everyone else's."""

    def __init__(self, dht: SwarmDHT) -> None:
        self.dht = dht
        self.peer_id: PeerID = dht.peer_id
        # the identity's key (SwarmDHT signs with it): records name this peer id only
        self.subkey = self.peer_id.to_base58().encode() + RSASignatureValidator(dht.identity).local_public_key
        self._cfg: SwarmConfig | None = None  # set by join(); every record key holds its swarm id
        self._versions_reported: set[int] = set()  # other protocol versions seen in records, said once each
        self.announced: set[int] = set()  # stages this peer holds a record for
        # every DHT store of this peer's own records (stage, config, metrics, round declarations, claims, revocation
        # lists): they all go through ``_store``; published in its metrics (``PeerMetrics.dht_stores``)
        self.stores = 0

    async def join(
        self, cfg: SwarmConfig | None, *, create: bool, name: str = SwarmConfig().name, fetch_timeout_s: float = 15.0
    ) -> SwarmConfig:
        """Publish (``create``) or fetch-and-check the swarm config; from then on, check this swarm's stage records too."""
        name = cfg.name if cfg is not None else name
        self.dht.add_validators([config_validator(name)])
        if create:
            if cfg is None:
                raise MembershipError("the peer that creates a swarm needs a config")
            published = []
        else:
            published = await self._fetch_configs(name, fetch_timeout_s)
        self._cfg = reconcile_config(name, cfg, published)
        self.dht.add_validators([stage_validator(self.cfg)])
        await self.publish_config()
        return self.cfg

    @property
    def cfg(self) -> SwarmConfig:
        """The swarm's config, once ``join`` has published or fetched it."""
        if self._cfg is None:
            raise MembershipError("join() the swarm first: its records are keyed by the swarm id")
        return self._cfg

    async def _fetch_configs(self, name: str, timeout_s: float) -> list[SwarmConfig]:
        """Published configs, polling until ``timeout_s``: a fresh DHT may not see the records yet."""
        deadline = get_dht_time() + timeout_s
        while True:
            found = await self.dht.get(config_key(name), latest=True, return_future=True)
            records = found.value if found is not None and isinstance(found.value, dict) else {}
            configs = [cfg for item in records.values() if (cfg := parse_config_record(item.value)) is not None]
            if configs or get_dht_time() >= deadline:
                return configs
            await asyncio.sleep(0.5)

    async def publish_config(self) -> None:
        value = ConfigRecord(hash=self.cfg.hash(), toml=dumps_config(self.cfg)).dict()
        await self._store(config_key(self.cfg.name), value)

    async def announce(self, stage: int, status: StageStatus) -> None:
        await self._store(stage_key(self.cfg.swarm_id, stage), status.dict())
        self.announced.add(stage)

    async def retire(self, stage: int) -> None:
        """Replace this peer's record with a tombstone, so readers drop it before its TTL runs out."""
        await self._store(stage_key(self.cfg.swarm_id, stage), None)
        self.announced.discard(stage)

    async def retire_all(self) -> None:
        """Retire every stage record this peer announced (a server that moved held several)."""
        await asyncio.gather(*(self.retire(stage) for stage in sorted(self.announced)))

    async def replicas(self, stage: int) -> dict[PeerID, StageStatus]:
        """Live peers announcing ``stage`` (this one included) with this protocol version, and their status."""
        return await self._read(stage_key(self.cfg.swarm_id, stage), StageStatus)

    async def publish_metrics(self, metrics: PeerMetrics | None) -> None:
        """Publish this peer's metrics; None retires them (a tombstone, as ``retire``)."""
        await self._store(metrics_key(self.cfg.swarm_id), None if metrics is None else metrics.dict())

    async def metrics(self) -> dict[PeerID, PeerMetrics]:
        """The latest metrics of every live peer with this protocol version (this one included)."""
        return await self._read(metrics_key(self.cfg.swarm_id), PeerMetrics)

    async def declare_round(self, stage: int, round_: int, *, opened_at: float, expiration: float) -> None:
        """Tell the replicas of ``stage`` that this peer takes part in outer round ``round_`` (replacing its declaration
        of an earlier round: a peer is in one round of a stage at a time)."""
        declaration = RoundDeclaration(round=round_, opened_at=opened_at)
        await self._store(round_key(self.cfg.swarm_id, stage), declaration.dict(), expiration)

    async def round_declarations(self, stage: int, round_: int) -> dict[PeerID, float]:
        """Who declared for outer round ``round_`` of ``stage`` (this peer included), and when."""
        declared = await self._read(round_key(self.cfg.swarm_id, stage), RoundDeclaration)
        return {peer: record.opened_at for peer, record in declared.items() if record.round == round_}

    async def claim_recovery(self, stage: int, claim: RecoveryClaim, *, expiration: float) -> None:
        """Tell the swarm this peer means to rebuild ``stage``, until ``expiration`` (DHT time) at most."""
        await self._store(recovery_key(self.cfg.swarm_id, stage), claim.dict(), expiration)

    async def withdraw_recovery(self, stage: int) -> None:
        """Drop this peer's claim on ``stage`` (a tombstone, as ``retire``)."""
        await self._store(recovery_key(self.cfg.swarm_id, stage), None)

    async def recovery_claims(self, stage: int) -> dict[PeerID, RecoveryClaim]:
        """Live claims to rebuild ``stage`` (this peer's included)."""
        return await self._read(recovery_key(self.cfg.swarm_id, stage), RecoveryClaim)

    async def publish_revocations(self, signed: bytes) -> None:
        """Republish the authority's signed revocation list (one copy per peer: none can be hidden by another)."""
        await self._store(revocations_key(self.cfg.swarm_id), RevocationRecord(signed=signed).dict())

    async def revocation_lists(self) -> list[bytes]:
        """The signed revocation lists live peers republish, unchecked: the authority's signature is the reader's to check."""
        return [
            record.signed
            for record in (await self._read(revocations_key(self.cfg.swarm_id), RevocationRecord)).values()
        ]

    async def _read(self, key: str, kind: type[PeerRecord]) -> dict[PeerID, PeerRecord]:
        found = await self.dht.get(key, latest=True, return_future=True)
        if found is None or not isinstance(found.value, dict):
            return {}
        out, other_versions = {}, set()
        for subkey, item in found.value.items():
            peer = peer_from_subkey(subkey)
            if peer is None or item.value is None:
                continue
            try:
                record = kind.parse_obj(item.value)
            except pydantic.ValidationError:
                continue  # a node without our validators may relay anything
            if record.version == PROTOCOL_VERSION:
                out[peer] = record
            else:
                other_versions.add(record.version)
        if new_versions := other_versions - self._versions_reported:
            # otherwise peers of another release are simply invisible: an empty swarm, and no word why
            self._versions_reported |= new_versions
            logger.warning(
                f"ignoring records of swarmloco protocol version {', '.join(map(str, sorted(new_versions)))} "
                f"(this peer speaks {PROTOCOL_VERSION}): peers of another release cannot train with this one; "
                "run the same swarmloco release on every peer"
            )
        return out

    async def all_replicas(self) -> dict[int, dict[PeerID, StageStatus]]:
        """Replicas of every stage 0..S (0 = trainers)."""
        stages = range(self.cfg.stages.num_stages + 1)
        return dict(zip(stages, await asyncio.gather(*(self.replicas(i) for i in stages))))

    async def _store(self, key: str, value: object, expiration: float | None = None) -> None:
        expiration = expiration or get_dht_time() + self.cfg.timeouts.record_ttl_s
        self.stores += 1
        await self.dht.store(key, value, expiration, subkey=self.subkey, return_future=True)


def pipeline_replicas(replicas: dict[int, dict[PeerID, StageStatus]]) -> dict[int, dict[PeerID, StageStatus]]:
    """``all_replicas`` as the pipeline sees it: only the records of replicas that take microbatches (not full peers)."""
    return {stage: serving(peers) for stage, peers in replicas.items()}


def pick_stage(replicas: dict[int, dict[PeerID, StageStatus]]) -> int:
    """The middle stage a new server should join: fewest replicas, then least throughput (the bottleneck)."""
    middle = {stage: peers for stage, peers in replicas.items() if stage > 0}
    return min(middle, key=lambda s: (len(middle[s]), sum(p.samples_per_s for p in middle[s].values()), s))
