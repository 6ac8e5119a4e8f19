"""Attacks the tests and ``scripts/bench_adversary.py`` play against honest peers: poisoned activation-gradients,
forged stage records, a state liar, a round staller, stage servers that garble or never answer, decompression bombs.

    await microbatch(client, server, cfg, "evil1", grad=poisoned(cfg, 1))      # a stage server must refuse it
    liar = await start_state_liar(cfg, a.peer.maddrs, round_=1000, scale=1000.0)
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import struct
import zlib
from typing import Any

import torch
import zstandard
from hivemind.dht import DHT
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from compress.codecs import get_codec
from compress.wire import MAGIC, VERSION, decode_frame, encode_frame
from swarm.config import SwarmConfig
from swarm.dht.identity import identity_file, identity_peer_id, load_identity_key
from swarm.dht.membership import round_key
from swarm.dht.records import PROTOCOL_VERSION, StageStatus
from swarm.outer.replica import ReplicaSync
from swarm.outer.state import StageState, pack_state, weights_hash
from swarm.pipeline.protocol import Backward, Forward, StageClient
from swarm.pipeline.server import StageServer
from swarm.rpc.blobs import BlobServicer
from swarmtest.configs import BATCH, LOOPBACK, LOOPBACK_MADDRS, SEQ
from swarmtest.loopback import STAGE, LoopbackReplica, Peer, seeded_weights

INT8 = get_codec("int8")
HONEST_SCALE = 1e-2  # of the activation-gradients an honest trainer sends: only their spread matters, not their size


# ---- a stage server's trainer sends poisoned activation-gradients ----------------------------------------------------


def huge_scale(frame: bytes) -> bytes:
    """The int8 frame with its scale replaced by 3.4e38: finite, so every frame check passes, but its norm overflows."""
    parsed = decode_frame(frame)
    return encode_frame(
        parsed.codec_id, parsed.body, dtype=parsed.dtype, shape=parsed.shape, meta=struct.pack("<f", 3.4e38)
    )


def activations(cfg: SwarmConfig) -> torch.Tensor:
    return torch.randn(BATCH, SEQ, cfg.model.d_model)


async def microbatch(client: StageClient, server: PeerID, cfg: SwarmConfig, mb: str, grad: bytes | None = None) -> None:
    """A forward, then a backward with ``grad`` (an honest gradient if None); raises the backward's ``RemoteError``."""
    x = INT8.encode(activations(cfg))
    y = INT8.decode(await client.forward(server, Forward(mb=mb, stage=1, prev_stage=0, x=x), timeout=10))
    grad = grad or INT8.encode(torch.randn_like(y) * HONEST_SCALE)
    grad_x = INT8.decode(await client.backward(server, Backward(mb=mb, stage=1, grad=grad), timeout=10))
    assert grad_x.shape == y.shape


def poisoned(cfg: SwarmConfig, i: int) -> bytes:
    """Both ways to poison: a norm that overflows (the issue's attack), and a finite one 10⁴× the honest ones."""
    honest = torch.randn(BATCH, SEQ, cfg.model.d_model) * HONEST_SCALE
    return huge_scale(INT8.encode(honest)) if i % 2 == 0 else INT8.encode(honest * 1e4)


# ---- forged stage records ------------------------------------------------------------------------------------


async def forge_replicas(attacker: DHT, signer: RSASignatureValidator, key: str, victim: PeerID) -> set[bytes]:
    """Store attractive stage records under made-up peer ids and the victim's, signed with the attacker's own key
    (valid signatures: only the peer id is a lie); the forged subkeys a reader without the binding check sees."""
    made_up = [identity_peer_id(RSAPrivateKey()) for _ in range(3)] + [victim.to_base58()]
    subkeys = {peer.encode() + signer.local_public_key for peer in made_up}
    bait = StageStatus(samples_per_s=1e6, inner_steps=1).dict()  # far faster than the honest replica: routing's pick
    for subkey in subkeys:
        await attacker.store(key, bait, get_dht_time() + 300, subkey=subkey, return_future=True)
    return subkeys & await stored_subkeys(attacker, key)


def modified_peer(initial_peers: list[str]) -> tuple[DHT, RSASignatureValidator]:
    """A peer whose DHT node signs what it stores with its identity key and checks nothing else."""
    with identity_file(None) as (path, _):
        signer = RSASignatureValidator(load_identity_key(path))
        return DHT(
            initial_peers=initial_peers,
            start=True,
            host_maddrs=LOOPBACK_MADDRS,
            identity_path=str(path),
            record_validators=[signer],
        ), signer


async def stored_subkeys(dht: DHT, key: str) -> set[bytes]:
    """The subkeys under ``key`` that ``dht``'s node accepts (its validators checked each)."""
    found = await dht.get(key, latest=True, return_future=True)
    return set(found.value) if found is not None else set()


# ---- the outer step: a state liar, a round staller ------------------------------------------------------------------


async def start_state_liar(
    cfg: SwarmConfig,
    initial_peers: list[str],
    *,
    round_: int = 0,
    scale: float,
    echo: ReplicaSync | None = None,
    name: str = "liar",
    weights: dict[str, torch.Tensor] | None = None,
) -> Peer:
    """A peer announcing stage 1 at ``round_`` and serving the seeded weights ×``scale`` (or ``weights``: two liars
    given the same ``garbage_weights`` collude, one claim vouched by both) as that round's state (its
    record announces exactly those weights' hash, so only the vouching, not the hash check, can stop it). With
    ``echo``, it announces that honest replica's claim instead, round and weights hash as they change (so it holds a
    vouched claim, and only the hash check can stop it), and serves its weights as a state of that round."""
    liar = await Peer.join(name, cfg, initial_peers)
    weights = weights or {name: scale * t for name, t in seeded_weights(cfg).items()}
    servicer = BlobServicer()

    async def provide(name: str) -> bytes:
        served_round = echo.round if echo else round_
        return pack_state(StageState(stage=STAGE, round=served_round, schedule_step=0, params=weights, optimizer=None))

    servicer.provide("state", provide)
    await servicer.add_p2p_handlers(liar.p2p, namespace=cfg.swarm_id)
    status = lambda: (  # noqa: E731
        StageStatus(**echo.status_fields())
        if echo
        else StageStatus(outer_round=round_, global_hash=weights_hash(weights))
    )
    liar.every(cfg.timeouts.announce_period_s, lambda: liar.membership.announce(STAGE, status()))
    liar.servicer = servicer  # type: ignore[attr-defined]  # its served_bytes tell whether anyone fetched the lie
    return liar


def garbage_weights(cfg: SwarmConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random stage-1 weights with the seeded weights' norms, tensor by tensor: every norm check passes them."""
    g = torch.Generator().manual_seed(seed)
    return {n: (r := torch.randn(t.shape, generator=g)) * (t.norm() / r.norm()) for n, t in seeded_weights(cfg).items()}


async def start_round_staller(
    cfg: SwarmConfig, initial_peers: list[str], honest: list[LoopbackReplica], *, ago_s: float | None = None
) -> DHT:
    """A DHT node that keeps declaring itself in the honest replicas' next round with a time that would close the
    window before they arrive: 0 (the DHT's schema refuses it) and, in turn, a window and a bit ago (plausible); with
    ``ago_s``, only ``ago_s`` ago (the issue's two stallers: 60 s). It never offers a payload."""
    # its records are signed by its own identity key (bound to its peer id): only the schema and the readers stop them
    with identity_file(None) as (path, _):
        signer = RSASignatureValidator(load_identity_key(path))
        dht = await asyncio.to_thread(
            DHT,
            initial_peers=initial_peers,
            start=True,
            host_maddrs=[LOOPBACK],
            identity_path=str(path),
            record_validators=[signer],
        )
    subkey, key = dht.peer_id.to_base58().encode() + signer.local_public_key, round_key(cfg.swarm_id, STAGE)

    async def declare(opened_at: float) -> None:
        for round_ in sorted({replica.sync.round for replica in honest}):
            value = {"round": round_, "opened_at": opened_at, "version": PROTOCOL_VERSION}
            await dht.store(key, value, get_dht_time() + 30, subkey=subkey, return_future=True)

    async def stall() -> None:
        while True:
            if ago_s is None:
                await declare(0.0)
                await asyncio.sleep(0.1)
            await declare(get_dht_time() - (cfg.timeouts.matchmaking_s + 0.5 if ago_s is None else ago_s))
            await asyncio.sleep(0.1)

    dht.stall = asyncio.create_task(stall())  # type: ignore[attr-defined]  # kept on the DHT: lives as long as it
    return dht


# ---- stage servers that lie about their work: garbled forwards, silence ----------------------------------------------


def true_norm_noise(y: torch.Tensor) -> torch.Tensor:
    """Random activations with ``y``'s per-token norms: no shape, finiteness or norm check tells them from ``y``."""
    noise = torch.randn_like(y)
    return noise * (y.norm(dim=-1, keepdim=True) / noise.norm(dim=-1, keepdim=True).clamp_min(1e-12))


def garble(server: StageServer) -> None:
    """``server`` answers every forward with ``true_norm_noise`` of its true output (its backwards stay honest)."""
    honest = server._compute_forward
    server._compute_forward = lambda x: true_norm_noise(honest(x))  # type: ignore[method-assign]


def add_noise(server: StageServer, relative: float = 0.2) -> None:
    """``server`` answers every forward with its true output plus ``relative`` × ``true_norm_noise`` of it: just under
    the checks' tolerance for agreeing outright (``CheckRule.tolerance``, 0.25), where one check against an honest
    replica on the same weights agrees without a judgement."""
    honest = server._compute_forward
    server._compute_forward = lambda x: (y := honest(x)) + relative * true_norm_noise(y)  # type: ignore[method-assign]


def noisy_backward(server: StageServer, descent: float = 0.35) -> None:
    """``server`` computes its forwards and trains honestly, but returns its input gradient plus noise at right angles
    to it, sized so a backward probe measures ``descent`` (``ProbeRule.min_descent`` is 0.25): ‖noise‖² =
    (1/descent − 1) ‖g‖², the most a probe lets through, ~1.7× the gradient's norm at 0.35."""
    honest = server._compute_backward

    def noisy(*args: Any, **kwargs: Any) -> torch.Tensor:
        g = honest(*args, **kwargs)
        noise = torch.randn_like(g)
        noise -= (noise * g).sum() / (g * g).sum().clamp_min(1e-30) * g  # at right angles to g
        return g + noise * (g.norm() * (1.0 / descent - 1.0) ** 0.5 / noise.norm().clamp_min(1e-30))

    server._compute_backward = noisy  # type: ignore[method-assign]


def flip_backward(server: StageServer) -> None:
    """``server`` computes its forwards and trains honestly, but returns the sign-flipped input gradient."""
    honest = server._compute_backward

    def flipped(*args: Any, **kwargs: Any) -> torch.Tensor:
        return -honest(*args, **kwargs)

    server._compute_backward = flipped  # type: ignore[method-assign]


def pass_through(server: StageServer) -> None:
    """``server`` computes nothing: every forward returns its input and every backward the gradient it was given. A
    lazy server at no cost, whose replies pass every shape, norm and finiteness check (issue 42: +11% val loss)."""

    def lazy(x: torch.Tensor, keep: bool, times: Any, on: Any = None) -> tuple[torch.Tensor, tuple[int, int], None]:
        return x.to(server.device), (server.weights_epoch, server.inner_steps), None

    server._forward_at_step = lazy  # type: ignore[method-assign, assignment]
    server._compute_forward = lambda x: x.to(server.device)  # type: ignore[method-assign]
    server._compute_backward = lambda entry, grad, *args, **kwargs: grad  # type: ignore[method-assign]


def collude(*servers: StageServer) -> None:
    """Every one of ``servers`` answers a forward with the same wrong output for the same input: random activations of
    the input's per-token norm, drawn from a seed the input fixes. Two colluders checking each other agree exactly;
    a third replica refereeing between one of them and an honest server is outvoted (issue 42: ~2× the val loss)."""
    for server in servers:
        honest = server._forward_at_step

        def wrong(
            x: torch.Tensor, keep: bool, times: Any, on: Any = None, honest: Any = honest
        ) -> tuple[torch.Tensor, tuple[int, int], None]:
            _, at, _ = honest(x, False, times, on)  # the work is done (and timed) as an honest server's would be
            seed = int(hashlib.sha256(x.detach().cpu().float().numpy().tobytes()).hexdigest()[:8], 16)
            noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed))
            y = noise * (x.float().norm(dim=-1, keepdim=True) / noise.norm(dim=-1, keepdim=True).clamp_min(1e-12))
            return y.to(server.device), at, None

        server._forward_at_step = wrong  # type: ignore[method-assign, assignment]


def silence(server: StageServer) -> None:
    """``server`` takes every forward and backward and never answers (run it with a large ``max_pending``)."""

    async def never(peer: PeerID, request: object) -> bytes:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    server.forward = server.backward = never  # type: ignore[method-assign, assignment]


# ---- decompression bombs ----------------------------------------------------------------------------------------


def zeros_zstd(size: int) -> bytes:
    """``size`` zero bytes, zstd-compressed with their size declared, without ever holding them: a bomb of a body."""
    out = io.BytesIO()
    with zstandard.ZstdCompressor().stream_writer(out, size=size, closefd=False) as writer:
        for start in range(0, size, 1 << 20):
            writer.write(bytes(min(1 << 20, size - start)))
    return out.getvalue()


def bomb_frame(codec_id: int, shape: tuple[int, ...], meta: bytes, body_len: int) -> bytes:
    """A checksummed frame declaring ``shape`` and a zstd body of ``body_len`` zero bytes (the layout of compress/wire.py)."""
    payload, tail = zeros_zstd(body_len), struct.pack(f"<{len(shape)}I", *shape) + meta
    head = struct.pack("<4sBBBBBIIII", MAGIC, VERSION, codec_id, 0, 1, len(shape), len(meta), body_len, len(payload), 0)
    crc = zlib.crc32(payload, zlib.crc32(tail, zlib.crc32(head[:-4])))
    return head[:-4] + struct.pack("<I", crc) + tail + payload
