"""State download: the archive format and its checks, retries over replicas, and hash-checked blobs over real hivemind P2P
(``swarm/outer/transfer.py`` over ``swarm/rpc/blobs.py``)."""

from __future__ import annotations

import asyncio
import io
import math
from collections.abc import Awaitable, Callable

import pytest
import torch
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.proto import runtime_pb2

import swarm.outer.transfer as state_sync
import swarm.rpc.blobs as blobs
from swarm.dht.records import StageStatus
from swarm.outer.transfer import (
    StageState,
    StateClaim,
    catch_up_claims,
    download_state,
    newcomer_claims,
    pack_state,
    stage_claims,
    state_bytes_bound,
    unpack_state,
    weights_hash,
)
from swarm.rpc.auth import AccessDenied
from swarm.rpc.blobs import BlobClient, BlobServicer, TransferError


def template() -> dict[str, torch.Tensor]:
    return {"blocks.0.w": torch.zeros(4, 3), "blocks.0.g": torch.zeros(3)}


def state(round_: int = 5, seed: int = 0) -> StageState:
    g = torch.Generator().manual_seed(seed)
    params = {name: torch.randn(t.shape, generator=g) for name, t in template().items()}
    optimizer = {
        "state": {0: {"momentum_buffer": torch.ones(4, 3)}, 1: {"momentum_buffer": None}},
        "param_groups": [{"lr": 0.7, "momentum": 0.9, "params": [0, 1]}],
    }
    return StageState(stage=2, round=round_, schedule_step=123, params=params, optimizer=optimizer)


def test_state_round_trips_and_its_hash_names_the_exact_weights() -> None:
    original = state()
    back = unpack_state(pack_state(original), stage=2, template=template())
    assert (back.stage, back.round, back.schedule_step) == (2, 5, 123)
    assert weights_hash(back.params) == weights_hash(original.params)
    assert torch.equal(back.optimizer["state"][0]["momentum_buffer"], torch.ones(4, 3))
    nudged = dict(
        original.params, **{"blocks.0.g": torch.nextafter(original.params["blocks.0.g"], torch.tensor(math.inf))}
    )
    assert weights_hash(nudged) != weights_hash(original.params)  # one ulp anywhere changes it
    assert len(weights_hash(original.params)) == 16


class Evil:
    def __reduce__(self) -> tuple:
        return (print, ("pwned",))


def archive(**changes: object) -> bytes:
    s = state()
    blob = {
        "format": state_sync.STATE_FORMAT,
        "stage": 2,
        "round": 5,
        "schedule_step": 1,
        "params": s.params,
        "optimizer": s.optimizer,
    } | changes
    buffer = io.BytesIO()
    torch.save(blob, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize(
    "data, problem",
    [
        (b"not an archive", "unreadable"),
        (archive(format="other"), "archive"),
        (archive(stage=3), "stage 3"),
        (archive(round=-1), "non-negative"),
        (archive(round=True), "non-negative"),
        (archive(params={"blocks.0.w": torch.zeros(4, 3)}), "names"),
        (archive(params={"blocks.0.w": torch.zeros(3, 4), "blocks.0.g": torch.zeros(3)}), "shape"),
        (
            archive(params={"blocks.0.w": torch.zeros(4, 3, dtype=torch.float64), "blocks.0.g": torch.zeros(3)}),
            "float32",
        ),
        (archive(params={"blocks.0.w": torch.full((4, 3), math.nan), "blocks.0.g": torch.zeros(3)}), "non-finite"),
        (archive(optimizer={"state": {0: {"momentum_buffer": torch.ones(5)}}, "param_groups": []}), "shape"),
        (archive(optimizer={"state": {7: {}}, "param_groups": []}), "not one of"),
        (archive(optimizer=[1, 2]), "state_dict"),
        (archive(params=Evil()), "unreadable"),  # weights_only: no code runs on load
    ],
)
def test_a_state_that_does_not_fit_the_stage_is_refused(data: bytes, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        unpack_state(data, stage=2, template=template())


def test_download_moves_on_to_the_next_replica_until_one_delivers() -> None:
    asked: list[str] = []

    async def fetch(peer: str, name: str) -> bytes:
        asked.append(peer)
        assert name == "state/2"
        if peer == "gone":
            raise TransferError("unreachable")
        return b"junk" if peer == "broken" else pack_state(state(round_=9))

    peer, got = asyncio.run(download_state(fetch, ["gone", "broken", "good", "never"], stage=2, template=template()))
    assert (peer, got.round, asked) == ("good", 9, ["gone", "broken", "good"])
    with pytest.raises(TransferError, match="gone: unreachable.*broken: unreadable"):
        asyncio.run(download_state(fetch, ["gone", "broken"], stage=2, template=template()))
    with pytest.raises(TransferError, match="no replica to ask"):
        asyncio.run(download_state(fetch, [], stage=2, template=template()))


H5, H6, LIE = "5" * 16, "6" * 16, "f" * 16  # weights hashes


def follows(
    others: dict[str, tuple[int, str]], me: str, own: tuple[int, str]
) -> list[tuple[int, str, tuple[str, ...]]]:
    """The claims a replica ``me`` holding (round, hash) ``own`` would download, as (round, hash, holders)."""
    statuses = {peer: StageStatus(outer_round=r, global_hash=h) for peer, (r, h) in others.items()}
    claims = stage_claims(statuses, me=(me, *own))
    return [
        (c.round, c.weights_hash, c.holders) for c in catch_up_claims(claims, round_=own[0], weights_hash=own[1], me=me)
    ]


def test_a_replica_follows_a_claim_two_replicas_vouch_for_and_never_one_peer_against_them() -> None:
    liar = {"liar": (1000, LIE)}
    # b agrees with me at round 5: the stage has a vouched claim, and the liar's later round is one peer's word
    assert follows({"b": (5, H5), **liar}, "c", (5, H5)) == []
    # two replicas vouch for round 6: that is the one to take, never the liar's
    assert follows({"a": (6, H6), "b": (6, H6), **liar}, "c", (5, H5)) == [(6, H6, ("a", "b"))]
    # a split round: the copy held by more replicas wins, whatever the peer ids; with as many, the smallest id
    assert follows({"b": (5, H6), "c": (5, H6)}, "a", (5, H5)) == [(5, H6, ("b", "c"))]
    assert follows({"a": (5, H6)}, "b", (5, H5)) == [(5, H6, ("a",))]
    assert follows({"b": (5, H6)}, "a", (5, H5)) == []
    # nobody agrees with anybody (a lone replica and the liar): the lone claim is tried, and checked for plausibility
    assert follows(liar, "c", (5, H5)) == [(1000, LIE, ("liar",))]


def test_a_newcomer_tries_vouched_claims_first_and_lone_ones_only_when_no_two_replicas_agree() -> None:
    status = lambda r, h: StageStatus(outer_round=r, global_hash=h)
    claims = stage_claims({"a": status(5, H5), "b": status(5, H5), "liar": status(1000, LIE)})
    assert [(c.round, c.holders) for c in newcomer_claims(claims)] == [(5, ("a", "b"))]
    claims = stage_claims({"a": status(5, H5), "liar": status(1000, LIE)})
    assert [(c.round, c.holders) for c in newcomer_claims(claims)] == [(1000, ("liar",)), (5, ("a",))]


def test_a_downloaded_state_must_be_the_claimed_one_and_a_lone_claim_plausible() -> None:
    good = state(round_=5)
    claim = StateClaim(round=5, weights_hash=weights_hash(good.params), holders=("a", "b"))
    claim.check(good)
    with pytest.raises(ValueError, match="round 6, its record claims round 5"):
        claim.check(state(round_=6))
    with pytest.raises(ValueError, match="its record claims"):
        claim.check(state(round_=5, seed=1))
    scaled = StageState(**{**vars(good), "params": {n: 1000 * t for n, t in good.params.items()}})
    lone = StateClaim(round=5, weights_hash=weights_hash(scaled.params), holders=("liar",))
    claim.acceptance(good.params, max_norm_ratio=10)(good)
    with pytest.raises(ValueError, match="beyond ×10"):
        lone.acceptance(good.params, max_norm_ratio=10)(scaled)
    vouched = StateClaim(round=5, weights_hash=weights_hash(scaled.params), holders=("a", "b"))
    vouched.acceptance(good.params, max_norm_ratio=10)(scaled)  # two replicas' word: a replica may have diverged


def test_state_bound_covers_weights_and_a_momentum_buffer() -> None:
    assert len(pack_state(state())) < state_bytes_bound(template())


class LyingServicer(BlobServicer):
    """Announces the hash of the real blob, then flips a byte on the way."""

    async def rpc_blob(self, request: runtime_pb2.ExpertRequest, context: P2PContext):  # type: ignore[override]
        async for message in super().rpc_blob(request, context):
            if len(message.metadata) > 1000:
                message = runtime_pb2.ExpertResponse(metadata=bytes([message.metadata[0] ^ 1]) + message.metadata[1:])
            yield message


class OnlyOk:
    """A verifier that admits requests carrying the certificate b"ok"."""

    def check(self, peer: PeerID, certificate: bytes | None) -> None:
        if certificate != b"ok":
            raise AccessDenied("missing", f"{peer} has no certificate")


def serve(servicer: BlobServicer, blobs: dict[str, bytes]) -> BlobServicer:
    async def provide(name: str) -> bytes:
        if name == "state/hang":
            await asyncio.sleep(3600)
        if name not in blobs:
            raise LookupError(name)
        return blobs[name]

    servicer.provide("state", provide)
    return servicer


async def with_peers(n: int, body: Callable[[list[P2P]], Awaitable[None]]) -> None:
    first = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    peers = [first] + [
        await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=await first.get_visible_maddrs())
        for _ in range(n - 1)
    ]
    try:
        await body(peers)
    finally:
        await asyncio.gather(*(p.shutdown() for p in peers))


def test_blobs_over_p2p_arrive_whole_or_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blobs, "CHUNK_BYTES", 4096)  # the state below crosses in several messages
    good = pack_state(state(round_=11))

    async def body(peers: list[P2P]) -> None:
        honest, liar, private, me = peers
        await serve(BlobServicer(), {"state/2": good}).add_p2p_handlers(honest, namespace="t")
        await BlobServicer().add_p2p_handlers(
            liar, wrapper=serve(LyingServicer(), {"state/2": good}), namespace="t"
        )  # under BlobServicer's names
        await serve(BlobServicer(verifier=OnlyOk()), {"state/2": good}).add_p2p_handlers(private, namespace="t")
        client = BlobClient(me, namespace="t")
        fetch = lambda peer, name, **kw: client.fetch(peer, name, **({"timeout": 10, "max_bytes": 1 << 20} | kw))

        assert await fetch(honest.peer_id, "state/2") == good
        assert client.received_bytes == len(good)
        for name, problem in [("state/9", "no blob"), ("../etc", "name"), ("other/1", "nothing is served")]:
            with pytest.raises(TransferError, match=problem):
                await fetch(honest.peer_id, name)
        with pytest.raises(TransferError, match="at most 100 are accepted"):
            await fetch(honest.peer_id, "state/2", max_bytes=100)
        with pytest.raises(TransferError, match="hash mismatch"):
            await fetch(liar.peer_id, "state/2")
        with pytest.raises(TransferError, match="no whole blob within"):
            await fetch(honest.peer_id, "state/hang", timeout=0.5)
        with pytest.raises(TransferError, match="denied"):
            await fetch(private.peer_id, "state/2")
        assert (
            await BlobClient(me, namespace="t", certificate=lambda: b"ok").fetch(
                private.peer_id, "state/2", timeout=10, max_bytes=1 << 20
            )
            == good
        )

        async def by_name(peer: str, name: str) -> bytes:
            return await fetch(PeerID.from_base58(peer), name)

        source, adopted = await download_state(
            by_name, [liar.peer_id.to_base58(), honest.peer_id.to_base58()], stage=2, template=template()
        )
        assert (
            source == honest.peer_id.to_base58() and adopted.round == 11
        )  # the corrupted transfer was retried elsewhere

    asyncio.run(with_peers(4, body))
