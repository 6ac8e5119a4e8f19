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
from swarm.outer.transfer import StageState, download_state, pack_state, state_bytes_bound, unpack_state, weights_hash
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
