"""A stage's state and its wire format: what a replica serves and a newcomer or straggler adopts.

``StageState`` holds the global weights, the outer optimizer's state, the round and the schedule step.
It travels as ``STATE_FORMAT`` (a magic line, a msgpack header of names and shapes, raw float32 values):
nothing is unpickled, and ``StateDecoder`` checks every tensor against the receiver's stage as it arrives.

    >>> blob = stream_state(state); state = unpack_state(pack_state(state), stage=2, template=params)
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from compress.codec_base import all_finite
from swarm.rpc import blobs
from swarm.rpc.blobs import BlobStream

STATE_FORMAT = "swarmloco-stage-state-v2"
_MAGIC = STATE_FORMAT.encode() + b"\n"
_LENGTH = struct.Struct("<I")  # the header's length, after the magic
MAX_HEADER_BYTES = 1 << 20  # names and shapes: kilobytes for any stage
ChunkReader = Callable[[Callable[[], bytes]], Awaitable[bytes]]  # runs one chunk's copy where the tensors hold still


@dataclass(frozen=True, kw_only=True)
class StageState:
    """One stage's shared state: what a replica adopts to take part from round ``round`` on."""

    stage: int
    round: int  # outer rounds completed
    schedule_step: int  # inner steps on the lr schedule
    params: dict[str, torch.Tensor]  # the global weights (the local ones when the swarm has no outer step)
    optimizer: dict[str, Any] | None  # the outer optimizer's torch state_dict; None without an outer step


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


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A tensor's bytes, flat: a view where the tensor is a contiguous CPU tensor, else one copy."""
    t = tensor.detach().cpu().contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().data


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


def _pack_header(*, stage: int, round_: int, schedule_step: int, params: list[Any], slots: list[Any] | None) -> bytes:
    fields = {"stage": stage, "round": round_, "schedule_step": schedule_step, "params": params, "optimizer": slots}
    header: bytes = msgpack.packb(fields, use_bin_type=True)
    return header


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
        self._check_params(header["params"])
        self._check_optimizer_slots(header["optimizer"])
        if raw != _pack_header(
            stage=header["stage"],
            round_=header["round"],
            schedule_step=header["schedule_step"],
            params=header["params"],
            slots=header["optimizer"],
        ):
            raise ValueError("the state header is not in its canonical encoding")
        expected_size = len(self._prelude) + sum(4 * shape.numel() for _, shape in self._slots)
        if self._size is not None and expected_size != self._size:
            raise ValueError(f"the state header declares {expected_size} bytes, the stream has {self._size}")
        self._header = header
        self._skip_empty()

    def _check_params(self, params: Any) -> None:
        """The header's [name, shape] list: this stage's names, in its order, and shapes."""
        names = (
            [p[0] if isinstance(p, list) and len(p) == 2 else None for p in params] if isinstance(params, list) else []
        )
        if names != list(self.template):
            raise ValueError("the state's parameter names differ from this stage's")
        shapes = [t.shape for t in self.template.values()]
        for (name, shape), expected in zip(params, shapes, strict=True):
            _check_shape(name, shape, expected)
            self._slots.append((name, expected))

    def _check_optimizer_slots(self, slots: Any) -> None:
        """The header's outer optimizer slots (None: no outer step): [parameter index, key, shape or None] each."""
        if slots is None:
            return
        if not isinstance(slots, list):
            raise ValueError("the outer optimizer state is not a list of slots")
        shapes = [t.shape for t in self.template.values()]
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
