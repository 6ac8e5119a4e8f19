"""A stage's state: the archive a live replica serves and a newcomer or straggler adopts, its checks and its download.

A stage's state is what a replica needs to take part from the next round on: the global weights,
the outer optimizer's state, the round number and the inner step count on the lr schedule. It
travels as a stream of its own (``STATE_FORMAT``): a magic line, a msgpack header of names and shapes, then every
tensor's little-endian float32 values, so nothing on the wire is unpickled and no code runs on load; the receiver
checks every tensor against its own stage (names, shapes, finite values) as the bytes arrive (``StateDecoder``).

No single peer can make another adopt a state. Replicas announce the ``(outer_round, global_hash)``
they hold in their stage records (the hash every member of a round publishes after applying it),
and a state is downloaded only as the fulfilment of such a **claim**: its round and weights hash
must be the claimed ones. A claim is *vouched for* when two or more replicas announce it (the
downloader's own record counts). Whenever the stage has a vouched claim, unvouched ones are
ignored: a peer announcing a later round alone takes over nothing. Only a stage with no two
replicas in agreement (a lone replica, a pair split by a failed round) falls back to a lone
claim, and then only to weights whose per-tensor norms are close to the downloader's own (a
newcomer's: the seeded initial weights', ``stages.seeded_norms``; ``check_plausible``): a lone liar cannot install scaled
or zeroed weights.

It moves between peers as a named blob (``swarm/rpc/blobs.py``): ``state/<stage>`` (the last outer
round's, with the outer optimizer) and ``local/<stage>`` (a replica's current local weights, which
a stage rebuild ``swarm/recovery/rebuild.py`` and ``swarmloco export`` fall back to where no claim is vouched).

    >>> blobs = BlobServicer(); blobs.provide("state", lambda name: replica.export_state())
    >>> await blobs.add_p2p_handlers(p2p, namespace=cfg.swarm_id)
    >>> fetch = functools.partial(BlobClient(p2p, namespace=cfg.swarm_id).fetch, timeout=30, max_bytes=state_bytes_bound(params))
    >>> peer, state = await download_state(fetch, candidates, stage=2, template=params)
    >>> claims = catch_up_claims(stage_claims(others, me=(me, 7, own_hash)), round_=7, weights_hash=own_hash, me=me)
    >>> peer, state = await download_state(fetch, claims[0].holders, stage=2, template=params, check=claims[0].check)
    >>> claim, peer, state = await download_claimed(fetch, newcomer_claims(claims), stage=2, template=params, check_for=lambda c: c.check)
"""

from __future__ import annotations

import functools
import hashlib
import logging
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from compress.codecs import all_finite
from swarm.dht.records import StageStatus
from swarm.rpc import blobs
from swarm.rpc.blobs import BlobStream, Sink, TransferError

logger = logging.getLogger(__name__)

STATE_FORMAT = "swarmloco-stage-state-v2"
_MAGIC = STATE_FORMAT.encode() + b"\n"
_LENGTH = struct.Struct("<I")  # the header's length, after the magic
MAX_HEADER_BYTES = 1 << 20  # names and shapes: kilobytes for any stage
# (peer, blob name, sink) → the blob's SHA-256 once it has streamed into the sink whole, or TransferError
StreamFetch = Callable[[str, str, Sink], Awaitable[str]]
ChunkReader = Callable[[Callable[[], bytes]], Awaitable[bytes]]  # runs one chunk's copy where the tensors hold still
# What a state's weights are held to: a replica's own or the seeded weights, or their norms (name → norm)
Reference = Mapping[str, torch.Tensor] | Mapping[str, float]
# A lone claim's weights may differ from a replica's own by at most this factor in any tensor's norm: an honest
# replica a few rounds ahead differs by a few percent, a liar's scaled (×1000) or zeroed weights by far more.
LONE_CLAIM_MAX_NORM_RATIO = 10.0
# A newcomer compares with the seeded initial weights, which training moves much further (yet not ×100).
NEWCOMER_MAX_NORM_RATIO = 100.0


@dataclass(frozen=True, kw_only=True)
class StageState:
    """One stage's shared state: what a replica adopts to take part from round ``round`` on."""

    stage: int
    round: int  # outer rounds completed
    schedule_step: int  # inner steps on the lr schedule
    params: dict[str, torch.Tensor]  # the global weights (the local ones when the swarm has no outer step)
    optimizer: dict[str, Any] | None  # the outer optimizer's torch state_dict; None without an outer step


StateCheck = Callable[[StageState], None]  # raises ValueError for a state the downloader must not adopt


class RecordBehind(ValueError):
    """A holder served a later round than its record claims: it did a round after it last announced (records lag by
    up to an announce period). Refused, since nothing vouches for the later weights, but no sign of a lie: no strike."""


@dataclass(frozen=True, kw_only=True)
class StateClaim:
    """Replicas announcing that they hold the global weights ``weights_hash`` after ``round`` outer rounds."""

    round: int
    weights_hash: str  # "" when the stage has no outer step (nothing to vouch for)
    holders: tuple[str, ...]  # peer ids, sorted; the downloader's own id when it holds this state too

    @property
    def vouched(self) -> bool:
        """Announced by more than one replica: no single peer's word."""
        return len(self.holders) >= 2 and bool(self.weights_hash)

    def check(self, state: StageState) -> None:
        """ValueError unless ``state`` is exactly the claimed one: its round, and weights that hash as announced
        (``RecordBehind`` for a later round: the holder's record lags, which is refused but not blamed)."""
        if state.round > self.round:
            raise RecordBehind(f"served the state of round {state.round}, its record still claims round {self.round}")
        if state.round != self.round:
            raise ValueError(f"served the state of round {state.round}, its record claims round {self.round}")
        if self.weights_hash and (served := weights_hash(state.params)) != self.weights_hash:
            raise ValueError(f"served weights hashing to {served}, its record claims {self.weights_hash}")

    def acceptance(self, reference: Reference, *, max_norm_ratio: float) -> StateCheck:
        """What a state downloaded for this claim must pass: when vouched for, be exactly the claimed one (``check``);
        on one peer's word only, be of the claimed round or a later one (the peer may have done rounds since it
        announced; its word is all there is either way) and hold weights whose norms stay within
        ``max_norm_ratio`` of ``reference``'s (``check_plausible``)."""
        if self.vouched:
            return self.check

        def check(state: StageState) -> None:
            if state.round < self.round:
                raise ValueError(f"served the state of round {state.round}, its record claims round {self.round}")
            check_plausible(state.params, reference, max_norm_ratio=max_norm_ratio)

        return check


def stage_claims(others: Mapping[str, StageStatus], *, me: tuple[str, int, str] | None = None) -> list[StateClaim]:
    """The stage's claims from its replicas' records (``others``) and, as (peer id, round, hash), the downloader's own."""
    holders: dict[tuple[int, str], list[str]] = {}
    for peer, status in others.items():
        holders.setdefault((status.outer_round, status.global_hash), []).append(peer)
    if me is not None and me[2]:
        holders.setdefault((me[1], me[2]), []).append(me[0])
    return [StateClaim(round=r, weights_hash=h, holders=tuple(sorted(peers))) for (r, h), peers in holders.items()]


def newcomer_claims(claims: Sequence[StateClaim]) -> list[StateClaim]:
    """The claims a replica with no state of its own tries, best first: the vouched ones if the stage has any (latest
    round, then most holders), else the lone ones (latest round first)."""
    vouched = [c for c in claims if c.vouched]
    return sorted(vouched or claims, key=lambda c: (-c.round, -len(c.holders), c.holders))


def newcomer_acceptance(seeded: Reference) -> Callable[[StateClaim], StateCheck]:
    """What a peer holding none of a stage's weights asks of each claim's state: exactly the claimed one when vouched
    for, else weights within ``NEWCOMER_MAX_NORM_RATIO`` of the ``seeded`` ones (the stage's seeded weights, or
    their norms: ``stages.seeded_norms``) (``StateClaim.acceptance``)."""
    return lambda claim: claim.acceptance(seeded, max_norm_ratio=NEWCOMER_MAX_NORM_RATIO)


def catch_up_claims(claims: Sequence[StateClaim], *, round_: int, weights_hash: str, me: str) -> list[StateClaim]:
    """The claims a replica at ``round_`` holding ``weights_hash`` should download, best first; empty: keep its own.

    It follows a claim to a later round, or one at its own round with other weights (a group split
    by a DHT race) that has more holders than its own, or as many and the smallest peer id. With a
    vouched claim anywhere in the stage (its own included), it follows only vouched claims.
    """
    own = StateClaim(round=round_, weights_hash=weights_hash, holders=(me,))
    own = next((c for c in claims if c.round == round_ and c.weights_hash == weights_hash and me in c.holders), own)

    def better(c: StateClaim) -> bool:
        if c.round != round_:
            return c.round > round_
        if not c.weights_hash or c.weights_hash == weights_hash:
            return False
        return (-len(c.holders), c.holders[0]) < (-len(own.holders), own.holders[0])

    ahead = [c for c in claims if better(c)]
    if any(c.vouched for c in claims):
        ahead = [c for c in ahead if c.vouched]
    return sorted(ahead, key=lambda c: (-c.round, -len(c.holders), c.holders))


def check_plausible(params: Mapping[str, torch.Tensor], reference: Reference, *, max_norm_ratio: float) -> None:
    """ValueError if a tensor's norm differs from ``reference``'s by more than ``max_norm_ratio`` either way.

    ``reference`` holds tensors, or their norms (``stages.seeded_norms``: the seeded weights', without drawing them).
    """
    for name, value in params.items():
        # float32 norms: 20× faster than float64 copies on a CPU, and ×max_norm_ratio leaves room for their rounding
        given = reference[name]
        ref = float(given) if isinstance(given, float) else float(given.detach().float().norm())
        norm = float(value.detach().float().norm())
        if ref > 0 and not ref / max_norm_ratio <= norm <= ref * max_norm_ratio:
            raise ValueError(
                f"{name}: norm {norm:.4g} against {ref:.4g} here, beyond ×{max_norm_ratio:g}: not a replica's weights"
            )


HASH_PIECE_BYTES = 1 << 24  # weights_hash hashes each tensor's bytes in pieces this long, in parallel


def weights_hash(params: Mapping[str, torch.Tensor], *, threads: int | None = None) -> str:
    """16 hex digits identifying exact weights: equal on replicas that agree, bit for bit.

    The SHA-256 of each tensor's name, length and the SHA-256 digests of its bytes in ``HASH_PIECE_BYTES`` pieces, in
    name order. The pieces are hashed where they lie (no copy) on ``threads`` threads (default: torch's; hashlib lets
    go of the GIL), so a 0.5B stage's 2 GB take a fraction of one pass; any thread count gives the same digest.
    """
    raw = {name: _bytes_of(params[name]) for name in sorted(params)}
    pieces = [
        data[start : start + HASH_PIECE_BYTES]
        for data in raw.values()
        for start in range(0, len(data), HASH_PIECE_BYTES)
    ]
    workers = min(threads or torch.get_num_threads(), len(pieces))
    if workers > 1 and sum(map(len, raw.values())) > 4 * HASH_PIECE_BYTES:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hash") as pool:
            digests = iter(list(pool.map(lambda piece: hashlib.sha256(piece).digest(), pieces)))
    else:
        digests = (hashlib.sha256(piece).digest() for piece in pieces)
    h = hashlib.sha256()
    for name, data in raw.items():
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little"))
        for _ in range(0, len(data), HASH_PIECE_BYTES):
            h.update(next(digests))
    return h.hexdigest()[:16]


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's bytes as a flat uint8 array: a view where the tensor is a contiguous CPU tensor, else one copy."""
    t = tensor.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def pack_state(state: StageState) -> bytes:
    """The whole state stream as one buffer (a stage checkpoint file); ``stream_state`` sends it without building this."""
    prelude, tensors = _layout(state)
    return b"".join([prelude, *(_tensor_bytes(t, 0, t.numel()) for t in tensors)])


def stream_state(
    state: StageState, *, read: ChunkReader | None = None, on_sent: Callable[[str], None] = lambda sha256: None
) -> BlobStream:
    """The state as a blob made chunk by chunk while it is sent: at most one chunk (``CHUNK_BYTES``) copied at a time.

    ``read(copy)`` runs each chunk's copy where the tensors cannot change under it (a replica's outer
    thread) and raises if they changed since ``state`` was taken, which cuts the stream short: a
    receiver never gets a torn state. None: the tensors are this stream's own (a snapshot).
    """
    prelude, tensors = _layout(state)
    step = max(1, blobs.CHUNK_BYTES // 4)  # float32 values per chunk

    async def chunks() -> AsyncIterator[bytes]:
        yield prelude
        for t in tensors:
            for start in range(0, t.numel(), step):
                copy = functools.partial(_tensor_bytes, t, start, min(start + step, t.numel()))
                yield copy() if read is None else await read(copy)

    return BlobStream(size=len(prelude) + sum(4 * t.numel() for t in tensors), chunks=chunks(), on_sent=on_sent)


def unpack_state(data: bytes, *, stage: int, template: Mapping[str, torch.Tensor]) -> StageState:
    """Read and check a whole state stream (a stage checkpoint file) against this stage's own parameters; ValueError
    if it does not fit."""
    decoder = StateDecoder(stage=stage, template=template)
    decoder.open(len(data))
    decoder.write(data)
    return decoder.result()


def state_bytes_bound(template: Mapping[str, torch.Tensor]) -> int:
    """The largest state stream accepted for a stage: weights + one momentum buffer in fp32, and slack."""
    return 2 * 4 * sum(t.numel() for t in template.values()) + (4 << 20)


def _layout(state: StageState) -> tuple[bytes, list[torch.Tensor]]:
    """The stream's prelude (magic, header length, header) and the tensors whose float32 values follow, in order."""
    tensors = list(state.params.values())
    slots = None
    if state.optimizer is not None:
        slots = []
        for index, slot in sorted(state.optimizer["state"].items()):
            for key, value in slot.items():
                slots.append([index, key, None if value is None else list(value.shape)])
                tensors += [] if value is None else [value]
    header = _pack_header(
        stage=state.stage,
        round_=state.round,
        schedule_step=state.schedule_step,
        params=[[name, list(t.shape)] for name, t in state.params.items()],
        slots=slots,
    )
    return _MAGIC + _LENGTH.pack(len(header)) + header, tensors


def _pack_header(*, stage: int, round_: int, schedule_step: int, params: list, slots: list | None) -> bytes:
    fields = {"stage": stage, "round": round_, "schedule_step": schedule_step, "params": params, "optimizer": slots}
    return msgpack.packb(fields, use_bin_type=True)


def _tensor_bytes(t: torch.Tensor, start: int, end: int) -> bytes:
    """Values ``start:end`` of ``t`` (flattened) as little-endian float32 bytes, wherever ``t`` lives."""
    return t.detach().reshape(-1)[start:end].to("cpu", torch.float32).numpy().tobytes()


class StateDecoder:
    """A ``Sink`` that decodes a state stream straight into the tensors of the state it returns, checking as it goes.

    The header (at most ``MAX_HEADER_BYTES``) is checked against this stage's own parameters —
    stage, counters, names, shapes, optimizer slots, and the stream's size — before any tensor is
    allocated; each tensor is allocated when its first byte arrives and checked for non-finite
    values when its last one has. So a receiver holds the state it is building and one chunk, never
    a serialized copy. ``result()`` once the stream has arrived whole (``BlobClient.stream`` returned).
    """

    def __init__(self, *, stage: int, template: Mapping[str, torch.Tensor]) -> None:
        self.stage, self.template = stage, template
        self._size: int | None = None
        self._prelude = bytearray()  # magic, length and header, until the header is read
        self._header: dict[str, Any] | None = None
        self._slots: list[tuple[str, torch.Size]] = []  # (what, shape) of each tensor in the stream, in order
        self._tensors: list[torch.Tensor] = []  # those allocated so far
        self._filled = 0  # bytes of the current tensor received

    def open(self, size: int) -> None:
        if size > (bound := state_bytes_bound(self.template)):
            raise ValueError(f"a state stream of {size} bytes is over this stage's bound of {bound}")
        self._size = size

    def write(self, chunk: bytes) -> None:
        view = memoryview(chunk)
        while view.nbytes:
            if self._header is None:
                view = self._read_prelude(view)
                continue
            if len(self._tensors) == len(self._slots) and self._filled == 0:
                raise ValueError("the state stream runs on past its last tensor")
            view = self._fill(view)

    def result(self) -> StageState:
        """The state received: ValueError unless the stream was whole."""
        self._skip_empty()
        if self._header is None or len(self._tensors) < len(self._slots) or self._filled:
            raise ValueError("the state stream ended before its last tensor")
        header, tensors = self._header, iter(self._tensors)
        params = {name: next(tensors) for name in self.template}
        optimizer = None
        if header["optimizer"] is not None:
            slots: dict[int, dict[str, torch.Tensor | None]] = {}
            for index, key, shape in header["optimizer"]:
                slots.setdefault(index, {})[key] = None if shape is None else next(tensors)
            optimizer = {"state": slots, "param_groups": []}  # hyper-parameters are each replica's own
        return StageState(
            stage=self.stage,
            round=header["round"],
            schedule_step=header["schedule_step"],
            params=params,
            optimizer=optimizer,
        )

    def _read_prelude(self, view: memoryview) -> memoryview:
        """Take the prelude's bytes from ``view``; once the header is whole, check it. Returns what follows."""
        fixed = len(_MAGIC) + _LENGTH.size
        want = fixed if len(self._prelude) < fixed else fixed + _LENGTH.unpack_from(self._prelude, len(_MAGIC))[0]
        take = min(view.nbytes, want - len(self._prelude))
        self._prelude += view[:take]
        if not _MAGIC.startswith(bytes(self._prelude[: len(_MAGIC)])):
            raise ValueError(f"not a {STATE_FORMAT} stream")
        if len(self._prelude) == fixed and not 0 < (length := _LENGTH.unpack_from(self._prelude, len(_MAGIC))[0]) <= (
            MAX_HEADER_BYTES
        ):
            raise ValueError(f"a state header of {length} bytes, at most {MAX_HEADER_BYTES} accepted")
        if len(self._prelude) > fixed and len(self._prelude) == want:
            self._check_header(bytes(self._prelude[fixed:]))
        return view[take:]

    def _check_header(self, raw: bytes) -> None:
        try:
            header = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
            raise ValueError(f"unreadable state header: {e}") from None
        if not isinstance(header, dict) or set(header) != {"stage", "round", "schedule_step", "params", "optimizer"}:
            raise ValueError("the state header does not hold a stage state's fields")
        if header["stage"] != self.stage:
            raise ValueError(f"state of stage {header['stage']!r}, expected {self.stage}")
        counters = [header["round"], header["schedule_step"]]
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counters):
            raise ValueError(f"round and schedule_step must be non-negative integers, got {counters}")
        params = header["params"]
        names = (
            [p[0] if isinstance(p, list) and len(p) == 2 else None for p in params] if isinstance(params, list) else []
        )
        if names != list(self.template):
            raise ValueError("the state's parameter names differ from this stage's")
        shapes = [t.shape for t in self.template.values()]
        for (name, shape), expected in zip(params, shapes, strict=True):
            _check_shape(name, shape, expected)
            self._slots.append((name, expected))
        slots = header["optimizer"]
        if slots is not None:
            if not isinstance(slots, list):
                raise ValueError("the outer optimizer state is not a list of slots")
            seen = set()
            for slot in slots:
                if not (isinstance(slot, list) and len(slot) == 3 and isinstance(slot[1], str)):
                    raise ValueError(f"outer optimizer slot {slot!r:.80}: not [parameter, key, shape]")
                index, key, shape = slot
                if not (isinstance(index, int) and not isinstance(index, bool) and 0 <= index < len(shapes)):
                    raise ValueError(f"outer optimizer state for parameter {index!r}: not one of this stage's")
                if (index, key) in seen:
                    raise ValueError(f"outer optimizer {key} of parameter {index} twice")
                seen.add((index, key))
                if shape is not None:  # SGD without momentum keeps None buffers
                    what = f"outer optimizer {key} of parameter {index}"
                    _check_shape(what, shape, shapes[index])
                    self._slots.append((what, shapes[index]))
        if raw != _pack_header(
            stage=header["stage"],
            round_=header["round"],
            schedule_step=header["schedule_step"],
            params=params,
            slots=slots,
        ):
            raise ValueError("the state header is not in its canonical encoding")
        expected_size = len(self._prelude) + sum(4 * shape.numel() for _, shape in self._slots)
        if self._size is not None and expected_size != self._size:
            raise ValueError(f"the state header declares {expected_size} bytes, the stream has {self._size}")
        self._header = header
        self._skip_empty()

    def _fill(self, view: memoryview) -> memoryview:
        """Copy from ``view`` into the current tensor (allocated on its first byte); returns what is left."""
        if self._filled == 0:
            self._tensors.append(torch.empty(self._slots[len(self._tensors)][1], dtype=torch.float32))
        target = self._tensors[-1].view(-1).view(torch.uint8).numpy()
        take = min(view.nbytes, target.size - self._filled)
        target[self._filled : self._filled + take] = np.frombuffer(view[:take], dtype=np.uint8)
        self._filled += take
        if self._filled == target.size:
            self._filled = 0
            if not all_finite(self._tensors[-1]):
                raise ValueError(f"{self._slots[len(self._tensors) - 1][0]}: non-finite values")
            self._skip_empty()
        return view[take:]

    def _skip_empty(self) -> None:
        """Allocate the tensors with no values (no byte of theirs will arrive)."""
        while self._header is not None and len(self._tensors) < len(self._slots) and self._filled == 0:
            shape = self._slots[len(self._tensors)][1]
            if shape.numel():
                return
            self._tensors.append(torch.empty(shape, dtype=torch.float32))


def _check_shape(name: Any, shape: Any, expected: torch.Size) -> None:
    if not (isinstance(shape, list) and all(isinstance(n, int) and not isinstance(n, bool) for n in shape)):
        raise ValueError(f"{name!r:.80}: shape {shape!r:.80} is not a list of integers")
    if torch.Size(shape) != expected:
        raise ValueError(f"{name}: expected a float32 tensor of shape {tuple(expected)}, got {tuple(shape)}")


async def download_state(
    fetch: StreamFetch,
    peers: Sequence[str],
    *,
    stage: int,
    template: Mapping[str, torch.Tensor],
    blob: str = "state",
    check: StateCheck = lambda state: None,
    blame: Callable[[str, str], None] = lambda peer, why: None,
) -> tuple[str, StageState]:
    """The state of ``stage`` from the first of ``peers`` that delivers a valid one (each tried once, in order).

    ``blob``: ``state`` (the last outer round's, with the outer optimizer) or ``local`` (the replica's current weights).

    ``fetch(peer, name, sink)`` streams a blob into ``sink`` (a ``StateDecoder``, which decodes it as it arrives)
    and returns once it is whole and hash-checked, or raises ``TransferError``; a stream that does not fit the
    stage (refused as it arrives), or a state that ``check`` refuses (``StateClaim.check``: not the claimed
    weights), counts as a failed transfer too, and ``blame(peer, why)`` hears of it: the peer sent it (but not of a
    ``RecordBehind``: a state newer than the holder's record is a lagging record, not a lie).
    """
    failures = []
    for peer in peers:
        decoder = StateDecoder(stage=stage, template=template)
        try:
            try:
                await fetch(peer, f"{blob}/{stage}", decoder)
                state = decoder.result()
                check(state)
            except RecordBehind:
                raise  # its record lags its state: try the next holder, blame nobody
            except ValueError as e:
                blame(peer, str(e))
                raise
            return peer, state
        except (TransferError, ValueError) as e:
            logger.warning(f"state of stage {stage} from {peer}: {e}; trying another replica")
            failures.append(f"{peer}: {e}")
    raise TransferError(
        f"no replica of stage {stage} delivered its state ({'; '.join(failures) or 'no replica to ask'})"
    )


async def download_claimed(
    fetch: StreamFetch,
    claims: Sequence[StateClaim],
    *,
    stage: int,
    template: Mapping[str, torch.Tensor],
    check_for: Callable[[StateClaim], StateCheck],
    blob_for: Callable[[StateClaim], str] = lambda claim: "state",
    blame: Callable[[str, str], None] = lambda peer, why: None,
) -> tuple[StateClaim, str, StageState]:
    """The first of ``claims`` (in order) that one of its holders fulfils: (claim, peer, state).

    Each claim's state is the ``blob_for(claim)`` blob of its holders, and must pass ``check_for(claim)``
    (``StateClaim.check`` or ``StateClaim.acceptance``); ``TransferError`` naming every failure if none delivers.
    """
    failures = []
    for claim in claims:
        try:
            peer, state = await download_state(
                fetch,
                claim.holders,
                stage=stage,
                template=template,
                blob=blob_for(claim),
                check=check_for(claim),
                blame=blame,
            )
            return claim, peer, state
        except TransferError as e:
            failures.append(str(e))
    raise TransferError("; ".join(failures) or f"no replica of stage {stage} claims a state")
