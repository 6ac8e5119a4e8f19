"""Frames sent server to server (issue 43 §3), a stage server's side, pure code: the messages (``Deliver``, ``Fetch``),
the ``Inbox`` where delivered frames wait for the call that names them, and the ``Outbox`` of frames a server sent on
(kept for the trainer to fetch by digest: a fallback when a delivery went wrong, and the checks and probes of relayed
work). The RPC around them is relay_rpc.py; the trainer's side relaying.py. docs/architecture.md, "Frames sent server
to server".

A delivery is keyed by (trainer, microbatch, kind, sender): the trainer is the one the delivery names and the one whose
call takes it (authenticated by libp2p), the sender the authenticated pusher. A microbatch's frames of a kind go along
its path one after another (a hop takes its input before it sends its output on), so the key names one frame, even on a
full peer that serves consecutive stages. Bounded per sender and
in total, in count and bytes; what nobody takes is dropped after ``ttl_s``.

    >>> inbox.put(sender, Deliver(trainer=t, mb="mb3", kind="activations", frame=frame))
    >>> frame = await inbox.take(InboxKey(t, "mb3", "activations", sender), digest, wait_s=2.0)
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from compress.wire import frame_codec_id
from swarm.rpc.servicer import RequestError

# the error a call by reference gets when its input is not (or no longer, or not as committed) here: the trainer falls
# back to today's path for that hop (relaying.py). Not the sender's fault, nor the trainer's: no strike, no ban
MISSING_INPUT = "missing_input"
KINDS = ("activations", "gradients")


def digest(frame: bytes) -> bytes:
    """A frame's commitment: its SHA-256."""
    return hashlib.sha256(frame).digest()


@dataclass(frozen=True, kw_only=True)
class Deliver:
    """A frame pushed to the next server of ``trainer``'s microbatch ``mb``: the input of its forward ("activations") or
    the gradient of its output ("gradients")."""

    trainer: str
    mb: str
    kind: str
    frame: bytes


@dataclass(frozen=True, kw_only=True)
class Fetch:
    """The caller's frame of microbatch ``mb`` that hashes to ``digest``, as this server sent or received it."""

    mb: str
    digest: bytes


class InboxKey(NamedTuple):
    trainer: str
    mb: str
    kind: str
    sender: str


@dataclass(frozen=True, kw_only=True)
class RelayLimits:
    """What a server holds of frames delivered to it, and of frames it sent on. ``max_frame_bytes``: one frame (the
    stage's wire limits); per sender and in all, count and bytes; ``ttl_s``: how long a delivery waits (the rpc
    timeout), ``keep_s``: how long a sent frame is kept for a fetch (a microbatch's round trip and its checks)."""

    max_frame_bytes: int
    per_sender: int = 16
    per_sender_bytes: int = 256 << 20
    total: int = 64
    total_bytes: int = 1 << 30
    ttl_s: float = 30.0
    keep_s: float = 120.0
    kept: int = 64
    kept_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if min(self.max_frame_bytes, self.per_sender, self.per_sender_bytes, self.total, self.kept) < 1:
            raise ValueError(f"relay limits must be positive, got {self}")
        if not (self.ttl_s > 0 and self.keep_s > 0 and self.total_bytes >= self.per_sender_bytes):
            raise ValueError(f"relay limits: positive times, the total bytes at least a sender's, got {self}")


def check_delivery(delivery: Deliver, limits: RelayLimits) -> None:
    """``RequestError(INVALID)`` for a delivery no honest server sends: an unknown kind, a frame over the limit or with
    no frame header (decoded in full, within the stage's limits, only when a call takes it)."""
    if delivery.kind not in KINDS:
        raise RequestError(RequestError.INVALID, f"delivery kind {delivery.kind[:20]!r} is not one of {KINDS}")
    if len(delivery.frame) > limits.max_frame_bytes:
        raise RequestError(
            RequestError.INVALID, f"delivered frame of {len(delivery.frame)} bytes is over {limits.max_frame_bytes}"
        )
    if frame_codec_id(delivery.frame) is None:
        raise RequestError(RequestError.INVALID, "delivered frame has no frame header")


class Inbox:
    """Frames delivered to this server, waiting for the call that names them (``take``), bounded per sender and in all;
    a full inbox refuses busy (the sender's reply then says "not delivered" and the trainer falls back)."""

    def __init__(self, limits: RelayLimits, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self.clock = limits, clock
        self._frames: OrderedDict[InboxKey, tuple[bytes, float]] = OrderedDict()  # oldest first
        self._count: Counter[str] = Counter()  # per sender
        self._bytes: Counter[str] = Counter()
        self._total_bytes = 0
        self._waiting: dict[InboxKey, asyncio.Future[None]] = {}
        self.counters: Counter[str] = Counter()  # delivered, taken, expired, refused_full, missing, mismatched

    def __len__(self) -> int:
        return len(self._frames)

    @property
    def nbytes(self) -> int:
        return self._total_bytes

    def put(self, sender: str, delivery: Deliver) -> None:
        self.expire()
        key = InboxKey(delivery.trainer, delivery.mb, delivery.kind, sender)
        size, limits = len(delivery.frame), self.limits
        if key in self._frames:
            self._drop(key)  # the same sender again (a retry): the later frame
        if self._count[sender] >= limits.per_sender or self._bytes[sender] + size > limits.per_sender_bytes:
            self.counters["refused_full"] += 1
            raise RequestError(RequestError.BUSY, f"sender {sender} holds its most of this inbox")
        if len(self._frames) >= limits.total or self._total_bytes + size > limits.total_bytes:
            self.counters["refused_full"] += 1
            raise RequestError(RequestError.BUSY, "this server's inbox is full")
        self._frames[key] = (delivery.frame, self.clock())
        self._count[sender] += 1
        self._bytes[sender] += size
        self._total_bytes += size
        self.counters["delivered"] += 1
        if (waiter := self._waiting.get(key)) is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self, key: InboxKey, committed: bytes | None, *, wait_s: float) -> bytes:
        """The frame delivered under ``key``, once it is there (waiting at most ``wait_s``), if it hashes to the
        digest its sender committed; else ``RequestError(MISSING_INPUT)``."""
        if key not in self._frames and wait_s > 0:
            waiter = self._waiting.setdefault(key, asyncio.get_running_loop().create_future())
            try:
                await asyncio.wait_for(asyncio.shield(waiter), wait_s)
            except TimeoutError:
                pass
            finally:
                self._waiting.pop(key, None)
        if key not in self._frames:
            self.counters["missing"] += 1
            raise RequestError(MISSING_INPUT, f"no {key.kind} of {key.mb} delivered by {key.sender}")
        frame = self._drop(key)
        if committed is None or digest(frame) != committed:
            self.counters["mismatched"] += 1
            raise RequestError(
                MISSING_INPUT, f"the {key.kind} of {key.mb} from {key.sender} is not the frame committed"
            )
        self.counters["taken"] += 1
        return frame

    def find(self, trainer: str, mb: str, committed: bytes) -> bytes | None:
        """A frame still waiting here for ``trainer``'s ``mb`` with this digest (a fetch)."""
        for key, (frame, _) in self._frames.items():
            if key.trainer == trainer and key.mb == mb and digest(frame) == committed:
                return frame
        return None

    def expire(self) -> None:
        """Drop what waited over ``ttl_s`` (a delivery nobody asked for)."""
        deadline = self.clock() - self.limits.ttl_s
        while self._frames and next(iter(self._frames.values()))[1] <= deadline:
            self._drop(next(iter(self._frames)))
            self.counters["expired"] += 1

    def _drop(self, key: InboxKey) -> bytes:
        frame, _ = self._frames.pop(key)
        self._count[key.sender] -= 1
        self._bytes[key.sender] -= len(frame)
        if not self._count[key.sender]:
            del self._count[key.sender], self._bytes[key.sender]
        self._total_bytes -= len(frame)
        return frame


class Outbox:
    """Frames this server sent on, by (trainer, microbatch, digest), for the trainer to fetch: kept ``keep_s``, the
    oldest dropped first beyond ``kept`` frames or ``kept_bytes``; a microbatch's go when its backward came back."""

    def __init__(self, limits: RelayLimits, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits, self.clock = limits, clock
        self._frames: OrderedDict[tuple[str, str, bytes], tuple[bytes, float]] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._frames)

    def keep(self, trainer: str, mb: str, frame: bytes) -> bytes:
        """Keep ``frame``; its digest."""
        committed = digest(frame)
        key = (trainer, mb, committed)
        if key not in self._frames:
            self._frames[key] = (frame, self.clock())
            self._bytes += len(frame)
        self._trim()
        return committed

    def get(self, trainer: str, mb: str, committed: bytes) -> bytes | None:
        self._trim()
        kept = self._frames.get((trainer, mb, committed))
        return None if kept is None else kept[0]

    def forget(self, trainer: str, mb: str) -> None:
        """``trainer``'s ``mb`` is done here (its backward came back): its frames are needed no more."""
        for key in [key for key in self._frames if key[0] == trainer and key[1] == mb]:
            self._bytes -= len(self._frames.pop(key)[0])

    def _trim(self) -> None:
        deadline, limits = self.clock() - self.limits.keep_s, self.limits
        while self._frames and (
            len(self._frames) > limits.kept
            or self._bytes > limits.kept_bytes
            or next(iter(self._frames.values()))[1] <= deadline
        ):
            _, (frame, _) = self._frames.popitem(last=False)
            self._bytes -= len(frame)
