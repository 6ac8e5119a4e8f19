"""State download: a live replica serves its stage's state in hash-checked chunks; a newcomer or straggler adopts it.

The transport is a small blob service over hivemind P2P: a peer asks another for a named blob
(``state/2``, ``outer/2/17/payload/<peer>``, …) and gets a stream whose first message is a header
(size and SHA-256, or an error) and the rest raw chunks. The client bounds the size before it
reads, stops at the first byte too many, and checks the hash, so a truncated, corrupted or
oversized transfer raises ``TransferError`` and the caller tries another replica. The outer
step's all-gather (``swarm/outer/rounds.py``) moves its payloads through the same service.

Peers also serve ``local/<stage>``: the same archive holding their current local weights (no outer
optimizer state), which a stage rebuild (``swarm/recovery/rebuild.py``) and ``swarmloco export`` download.

A stage's state is what a replica needs to take part from the next round on: the global weights,
the outer optimizer's state, the round number and the inner step count on the lr schedule. It
travels as a ``torch.save`` archive read back with ``weights_only=True`` (no code runs on load),
and every tensor is checked against the receiver's own stage (names, shapes, finite values).

    >>> blobs = BlobServicer(); blobs.provide("state", lambda name: replica.export_state())
    >>> await blobs.add_p2p_handlers(p2p, namespace=cfg.swarm_id)
    >>> client = BlobClient(p2p, namespace=cfg.swarm_id)
    >>> peer, state = await download_state(client.fetch, candidates, stage=2, template=params, timeout_s=30)
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, AsyncIterator  # typing's AsyncIterator: hivemind reads stream handlers from it

import msgpack
import torch
from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.p2p.p2p_daemon_bindings.control import MAX_UNARY_PAYLOAD_SIZE
from hivemind.proto import runtime_pb2

from swarm.rpc.auth import CERTIFICATE_FIELD, AccessDenied, CertificateVerifier
from swarm.pipeline.protocol import TRANSPORT_ERRORS

logger = logging.getLogger(__name__)

CHUNK_BYTES = MAX_UNARY_PAYLOAD_SIZE // 2  # one stream message
BLOB_NAME = re.compile(r"\w[\w.-]{0,63}(/\w[\w.-]{0,63}){0,5}")  # e.g. "state/2", "outer/1/7/payload/12D3KooW…"
MAX_REQUEST_BYTES = 16 << 10  # a name and a certificate
STATE_FORMAT = "swarmloco-stage-state-v1"
Provider = Callable[[str], Awaitable[bytes]]  # full blob name → blob; raises LookupError if there is none
Fetch = Callable[[str, str], Awaitable[bytes]]  # (peer, blob name) → the verified blob, or TransferError


class TransferError(Exception):
    """A blob did not arrive whole: the peer refused, vanished, timed out, or sent bytes that do not match."""


class BlobServicer(ServicerBase):
    """Serves named blobs from providers registered by name prefix (the part before the first '/').

    ``verifier`` makes it private: every request must carry a certificate admitting its sender.
    """

    def __init__(self, *, verifier: CertificateVerifier | None = None, wait_s: float = 60.0) -> None:
        self.providers: dict[str, Provider] = {}
        self.verifier, self.wait_s = verifier, wait_s
        self.served_bytes = 0

    def provide(self, prefix: str, provider: Provider) -> None:
        self.providers[prefix] = provider

    async def rpc_blob(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        try:
            data = await self._lookup(request.metadata, context.remote_id)
        except TransferError as e:
            yield runtime_pb2.ExpertResponse(metadata=msgpack.packb({"error": str(e)}))
            return
        yield runtime_pb2.ExpertResponse(metadata=msgpack.packb({"size": len(data), "sha256": hashlib.sha256(data).digest()}))
        for start in range(0, len(data), CHUNK_BYTES):
            yield runtime_pb2.ExpertResponse(metadata=data[start : start + CHUNK_BYTES])
        self.served_bytes += len(data)

    async def _lookup(self, metadata: bytes, peer: PeerID) -> bytes:
        try:
            request = msgpack.unpackb(metadata, raw=False, max_bin_len=MAX_REQUEST_BYTES, max_str_len=1024) if len(metadata) <= MAX_REQUEST_BYTES else None
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            request = None
        name = request.get("name") if isinstance(request, dict) else None
        if not isinstance(name, str) or not BLOB_NAME.fullmatch(name):
            raise TransferError(f"a blob request is a map with a 'name' matching {BLOB_NAME.pattern}")
        if self.verifier is not None:
            try:
                self.verifier.check(peer, request.get(CERTIFICATE_FIELD))
            except AccessDenied as e:
                raise TransferError(f"denied: {e}") from None
        provider = self.providers.get(name.split("/", 1)[0])
        try:
            if provider is None:
                raise LookupError("nothing is served under that prefix")
            return await asyncio.wait_for(provider(name), self.wait_s)
        except (LookupError, asyncio.TimeoutError) as e:
            raise TransferError(f"no blob {name!r} here: {e}") from None


class BlobClient:
    """Fetches blobs from other peers' ``BlobServicer``; ``certificate`` (private swarms) goes with every request."""

    def __init__(self, p2p: P2P, *, namespace: str, certificate: Callable[[], bytes | None] = lambda: None) -> None:
        self.p2p, self.namespace, self.certificate = p2p, namespace, certificate
        self.received_bytes = 0

    async def fetch(self, peer: str | PeerID, name: str, *, timeout: float, max_bytes: int) -> bytes:
        """The blob, whole and hash-checked, within ``timeout`` seconds; else ``TransferError``."""
        peer = PeerID.from_base58(peer) if isinstance(peer, str) else peer
        request = {"name": name} | ({CERTIFICATE_FIELD: cert} if (cert := self.certificate()) else {})
        try:
            data = await asyncio.wait_for(self._read(peer, msgpack.packb(request, use_bin_type=True), max_bytes), timeout)
        except asyncio.TimeoutError:
            raise TransferError(f"{name} from {peer}: no whole blob within {timeout:.1f}s") from None
        except TRANSPORT_ERRORS as e:
            raise TransferError(f"{name} from {peer}: {type(e).__name__}: {e}") from None
        self.received_bytes += len(data)
        return data

    async def _read(self, peer: PeerID, request: bytes, max_bytes: int) -> bytes:
        stream = await BlobServicer.get_stub(self.p2p, peer, namespace=self.namespace).rpc_blob(runtime_pb2.ExpertRequest(metadata=request))
        try:
            header = msgpack.unpackb((await anext(stream)).metadata, raw=False, max_bin_len=64, max_str_len=4096)
        except (StopAsyncIteration, ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
            raise TransferError(f"unreadable header from {peer}: {e!r}") from None
        if not isinstance(header, dict) or "error" in header:
            raise TransferError(f"{peer} refused: {header.get('error') if isinstance(header, dict) else header!r}")
        size, digest = header.get("size"), header.get("sha256")
        if not (isinstance(size, int) and 0 <= size <= max_bytes and isinstance(digest, bytes)):
            raise TransferError(f"{peer} announced a blob of {size!r} bytes; at most {max_bytes} are accepted")
        parts, received = [], 0
        async for message in stream:
            received += len(message.metadata)
            if received > size:  # stop reading: never buffer more than announced
                break
            parts.append(message.metadata)
        data = b"".join(parts)
        if received != size or hashlib.sha256(data).digest() != digest:
            raise TransferError(f"blob from {peer} does not match its header: {received} of {size} bytes, hash "
                                f"{'ok' if hashlib.sha256(data).digest() == digest else 'mismatch'}")
        return data


@dataclass(frozen=True, kw_only=True)
class StageState:
    """One stage's shared state: what a replica adopts to take part from round ``round`` on."""

    stage: int
    round: int  # outer rounds completed
    schedule_step: int  # inner steps on the lr schedule
    params: dict[str, torch.Tensor]  # the global weights (the local ones when the swarm has no outer step)
    optimizer: dict[str, Any] | None  # the outer optimizer's torch state_dict; None without an outer step


def weights_hash(params: Mapping[str, torch.Tensor]) -> str:
    """16 hex digits identifying exact weights: equal on replicas that agree, bit for bit."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode() + b"\0")
        h.update(params[name].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def pack_state(state: StageState) -> bytes:
    buffer = io.BytesIO()
    torch.save({"format": STATE_FORMAT, "stage": state.stage, "round": state.round, "schedule_step": state.schedule_step,
                "params": state.params, "optimizer": state.optimizer}, buffer)
    return buffer.getvalue()


def state_bytes_bound(template: Mapping[str, torch.Tensor]) -> int:
    """The largest state archive accepted for a stage: weights + one momentum buffer in fp32, and slack."""
    return 2 * 4 * sum(t.numel() for t in template.values()) + (4 << 20)


def unpack_state(data: bytes, *, stage: int, template: Mapping[str, torch.Tensor]) -> StageState:
    """Read and check a state archive against this stage's own parameters; ValueError if it does not fit."""
    try:
        blob = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises many types for foreign or corrupt archives
        raise ValueError(f"unreadable state archive: {type(e).__name__}: {e}") from None
    if not isinstance(blob, dict) or blob.get("format") != STATE_FORMAT:
        raise ValueError(f"not a {STATE_FORMAT} archive")
    if blob.get("stage") != stage:
        raise ValueError(f"state of stage {blob.get('stage')!r}, expected {stage}")
    counters = [blob.get("round"), blob.get("schedule_step")]
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counters):
        raise ValueError(f"round and schedule_step must be non-negative integers, got {counters}")
    params = blob.get("params")
    if not isinstance(params, dict) or list(params) != list(template):
        raise ValueError("the state's parameter names differ from this stage's")
    for name, value in params.items():
        _check_tensor(name, value, template[name].shape)
    optimizer = blob.get("optimizer")
    if optimizer is not None:
        slots = optimizer.get("state") if isinstance(optimizer, dict) else None
        if not isinstance(slots, dict) or not isinstance(optimizer.get("param_groups"), list):
            raise ValueError("the outer optimizer state is not a torch optimizer state_dict")
        shapes = [t.shape for t in template.values()]
        for index, slot in slots.items():
            if not (isinstance(index, int) and 0 <= index < len(shapes) and isinstance(slot, dict)):
                raise ValueError(f"outer optimizer state for parameter {index!r}: not one of this stage's")
            for key, value in slot.items():
                if value is not None:  # SGD without momentum keeps None buffers
                    _check_tensor(f"outer optimizer {key} of parameter {index}", value, shapes[index])
    return StageState(stage=stage, round=blob["round"], schedule_step=blob["schedule_step"], params=params, optimizer=optimizer)


def _check_tensor(name: str, value: Any, shape: torch.Size) -> None:
    if not (isinstance(value, torch.Tensor) and value.dtype == torch.float32 and value.shape == shape):
        raise ValueError(f"{name}: expected a float32 tensor of shape {tuple(shape)}")
    if not torch.isfinite(value).all():
        raise ValueError(f"{name}: non-finite values")


async def download_state(fetch: Fetch, peers: Sequence[str], *, stage: int, template: Mapping[str, torch.Tensor],
                         blob: str = "state") -> tuple[str, StageState]:
    """The state of ``stage`` from the first of ``peers`` that delivers a valid one (each tried once, in order).

    ``blob``: ``state`` (the last outer round's, with the outer optimizer) or ``local`` (the replica's current weights).

    ``fetch(peer, name)`` returns a whole, hash-checked blob or raises ``TransferError``; a blob
    that arrives whole but does not fit the stage counts as a failed transfer too.
    """
    failures = []
    for peer in peers:
        try:
            return peer, unpack_state(await fetch(peer, f"{blob}/{stage}"), stage=stage, template=template)
        except (TransferError, ValueError) as e:
            logger.warning(f"state of stage {stage} from {peer}: {e}; trying another replica")
            failures.append(f"{peer}: {e}")
    raise TransferError(f"no replica of stage {stage} delivered its state ({'; '.join(failures) or 'no replica to ask'})")
