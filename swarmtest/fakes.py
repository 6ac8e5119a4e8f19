"""In-process fakes: the outer step's network in memory (``Hub``, ``MemoryNet``), stage RPC without sockets
(``InProcessNetwork`` through the servicers' envelope, ``DirectStages`` straight into the servers over a simulated
wire, ``EchoStages`` with no model at all), a servicer's backend with no model (``EchoBackend``), and a ``Holder``
whose inner step is a seeded random move (``RandomStepHolder``).

    hub = Hub(); hub.join("a"); net = MemoryNet(hub, "a")       # hub.dead / cut / slow: faults by peer
    net = InProcessNetwork(cfg, {"1a": 1, "2a": 2}); Trainer(cfg, net, net.router)
    net = DirectStages.of(cfg, {"s1": 1}, latency_s=0.05); Trainer(cfg, net, net.router)   # net.most_open, forwards
    StageServicer(EchoBackend(held=True), stage=1, max_request_bytes=4096)   # backend.gate.set() lets the calls go
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import TypeVar

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import runtime_pb2

from swarm.config import SwarmConfig
from swarm.dht.metrics import Traffic
from swarm.model.stages import build_stage
from swarm.outer.board import Board
from swarm.outer.group import RoundKey
from swarm.pipeline.metering import MeteredBackend
from swarm.pipeline.protocol import (
    Backward,
    Forward,
    RemoteError,
    Reply,
    RequestError,
    StageServicer,
    pack,
    parse_reply,
)
from swarm.pipeline.routing import Peer, Router
from swarm.pipeline.server import StageServer
from swarm.rpc.blobs import TransferError

T = TypeVar("T")
Hold = Callable[[Backward], Awaitable[None]]  # awaited before a backward reaches its server: holds or refuses it

CONTEXT = P2PContext(handle_name="test", local_id="server", remote_id="trainer")  # a servicer call from "trainer"


class Hub:
    """An in-memory swarm: the DHT's round declarations and every peer's board; peers can die, links can be cut."""

    def __init__(self) -> None:
        self.declared: dict[RoundKey, dict[str, float]] = {}
        self.boards: dict[str, Board] = {}
        self.dead: set[str] = set()
        self.cut: set[tuple[str, str]] = set()  # (fetcher, peer): that fetch fails
        self.slow: set[str] = set()  # peers that never answer (the fetch times out)
        self.fetches: list[tuple[str, str, str]] = []  # (fetcher, peer, blob name) of every fetch tried
        self.fetched_bytes: dict[str, int] = {}  # blob name → its size, for every blob a fetch delivered

    def join(self, me: str) -> None:
        self.boards[me] = Board(retention_s=60.0, clock=time.monotonic)


class MemoryNet:
    """One peer's ``GroupNetwork`` on a ``Hub``: declarations in the hub, payloads fetched from the others' boards."""

    def __init__(self, hub: Hub, me: str) -> None:
        self.hub, self.me = hub, me

    async def declare(self, key: RoundKey, opened_at: float, expiration: float) -> None:
        self.hub.declared.setdefault(key, {})[self.me] = opened_at

    async def declarations(self, key: RoundKey) -> dict[str, float]:
        return dict(self.hub.declared.get(key, {}))

    async def fetch(self, peer: str, name: str, timeout: float, *, max_bytes: int | None = None) -> bytes:
        self.hub.fetches.append((self.me, peer, name))
        if peer in self.hub.dead or (self.me, peer) in self.hub.cut:
            raise TransferError(f"{peer} is unreachable")

        async def answer() -> bytes:
            if peer in self.hub.slow:
                await asyncio.sleep(timeout + 1)
            return await self.hub.boards[peer].get(name)

        try:
            blob = await asyncio.wait_for(answer(), timeout)
        except (TimeoutError, LookupError) as e:
            raise TransferError(f"{peer}: {e!r}") from None
        if max_bytes is not None and len(blob) > max_bytes:  # as a BlobClient refuses its announced size, unread
            raise TransferError(f"{peer} announced a blob of {len(blob)} bytes; at most {max_bytes} are accepted")
        self.hub.fetched_bytes[name] = len(blob)
        return blob


class RandomStepHolder:
    """A ``Holder`` whose inner step moves every weight by a small seeded random step: the outer step only ever sees
    weights, so this is all of training it needs, at no compute cost."""

    def __init__(self, module: torch.nn.Module, seed: int, step_size: float) -> None:
        self.module = module
        self.inner_steps = self.start_step = 0
        self.step_size, self.rng = step_size, torch.Generator().manual_seed(seed)

    @classmethod
    def small(cls, seed: int) -> RandomStepHolder:
        """Two 8 × 8 linears, the same on every replica, moved by steps of 0.01."""
        torch.manual_seed(0)
        return cls(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)), seed, step_size=0.01)

    @classmethod
    def stage(cls, cfg: SwarmConfig, seed: int, stage: int = 1, step_size: float = 3e-4) -> RandomStepHolder:
        """The swarm's real ``stage`` (seeded weights, the same on every replica), moved by steps of ``step_size``."""
        return cls(build_stage(cfg.model, cfg.stages.num_stages, stage), seed, step_size)

    async def exclusive(self, fn: Callable[[], T], *, change: str = "none") -> T:
        return fn()

    @torch.no_grad()
    def train(self) -> None:
        for p in self.module.parameters():
            p.add_(self.step_size * torch.randn(p.shape, generator=self.rng))
        self.inner_steps += 1


def request(payload: bytes) -> runtime_pb2.ExpertRequest:
    """A servicer's request envelope around ``payload``."""
    return runtime_pb2.ExpertRequest(metadata=payload)


class InProcessNetwork:
    """``StageCalls`` straight into servicers, through the same envelope as over P2P. Peers in ``dead`` are unreachable."""

    def __init__(self, cfg: SwarmConfig, replicas: dict[str, int]) -> None:
        self.servers = {peer: StageServer(cfg, stage) for peer, stage in replicas.items()}
        self.traffic = {peer: Traffic() for peer in replicas}  # what each server counts, as a peer's metrics do
        self.servicers = {
            peer: StageServicer(
                MeteredBackend(s, self.traffic[peer]), stage=s.stage, max_request_bytes=s.max_request_bytes
            )
            for peer, s in self.servers.items()
        }
        self.dead: set[str] = set()
        self.router = Router(cfg.stages.num_stages, random.Random(0))
        for stage in range(1, cfg.stages.num_stages + 1):
            self.router.update(stage, [peer for peer, s in replicas.items() if s == stage])

    async def forward(self, peer: str, req: Forward, *, timeout: float) -> bytes:
        return await self._call(peer, "rpc_forward", req)

    async def backward(self, peer: str, req: Backward, *, timeout: float) -> bytes:
        return await self._call(peer, "rpc_backward", req)

    async def _call(self, peer: str, method: str, req: Forward | Backward) -> bytes:
        if peer in self.dead:
            raise RemoteError(RequestError.UNREACHABLE, f"{peer} is gone")
        return parse_reply((await getattr(self.servicers[peer], method)(request(pack(req)), CONTEXT)).metadata)

    def served(self, peer: str) -> int:
        return self.servers[peer].counters["backward"]


class DirectStages:
    """``StageCalls`` straight into ``StageServer``s by peer name (no envelope, no network), with a ``router`` over
    them, across a simulated wire: each call first waits ``latency_s`` (concurrent calls overlap, as on a wire), and with
    ``bytes_per_s`` each direction also takes its frames' bytes at that rate; a backward then awaits ``hold(request)``
    (a test holds it, or refuses it by raising). Counts each peer's training forwards (``forwards``) and the most
    microbatches open at once (``most_open``: forwarded, backward not yet answered)."""

    def __init__(
        self,
        servers: Mapping[str, StageServer],
        *,
        latency_s: float = 0.0,
        bytes_per_s: float | None = None,
        hold: Hold | None = None,
        route_seed: int = 0,
    ) -> None:
        self.servers: dict[Peer, StageServer] = {peer: server for peer, server in servers.items()}
        self.latency_s, self.bytes_per_s, self.hold = latency_s, bytes_per_s, hold
        num_stages = next(iter(self.servers.values())).cfg.stages.num_stages
        self.router = Router(num_stages, random.Random(route_seed))
        for stage in sorted({server.stage for server in self.servers.values()}):
            self.router.update(stage, [peer for peer, server in self.servers.items() if server.stage == stage])
        self.forwards: dict[Peer, int] = dict.fromkeys(self.servers, 0)  # training forwards by peer
        self.open: set[str] = set()  # microbatches forwarded, backward not yet answered
        self.most_open = 0

    @classmethod
    def of(
        cls,
        cfg: SwarmConfig,
        replicas: Mapping[str, int],
        *,
        latency_s: float = 0.0,
        bytes_per_s: float | None = None,
        hold: Hold | None = None,
        route_seed: int = 0,
    ) -> DirectStages:
        """A new ``StageServer`` of ``cfg`` for each peer of ``replicas`` (peer → stage)."""
        servers = {peer: StageServer(cfg, stage) for peer, stage in replicas.items()}
        return cls(servers, latency_s=latency_s, bytes_per_s=bytes_per_s, hold=hold, route_seed=route_seed)

    @property
    def server(self) -> StageServer:
        """The only server (for a fake of one)."""
        (server,) = self.servers.values()
        return server

    async def forward(self, peer: Peer, request: Forward, *, timeout: float) -> bytes:
        await asyncio.sleep(self.latency_s)
        await self._cross(len(request.x))
        if request.train:
            self.forwards[peer] += 1
            self.open.add(request.mb)
            self.most_open = max(self.most_open, len(self.open))
        reply = await self.servers[peer].forward("trainer", request)
        await self._cross(len(reply))
        return reply

    async def backward(self, peer: Peer, request: Backward, *, timeout: float) -> bytes:
        await asyncio.sleep(self.latency_s)
        await self._cross(len(request.grad) + len(request.x or b""))
        if self.hold is not None:
            await self.hold(request)
        reply = await self.servers[peer].backward("trainer", request)
        self.open.discard(request.mb)
        await self._cross(len(reply))
        return reply

    def shutdown(self) -> None:
        for server in self.servers.values():
            server.shutdown()

    async def _cross(self, nbytes: int) -> None:
        if self.bytes_per_s is not None:
            await asyncio.sleep(nbytes / self.bytes_per_s)


class EchoStages:
    """``StageCalls`` with no model: a peer answers a forward with its input frame (a backward with its gradient's)
    after ``delay_s``; a peer in ``silent`` never answers, so the caller's timeout ends the call. ``timeouts`` holds
    the timeout each peer was given, call by call."""

    def __init__(self, *, delay_s: float = 0.0, silent: Collection[Peer] = ()) -> None:
        self.delay_s, self.silent = delay_s, set(silent)
        self.timeouts: defaultdict[Peer, list[float]] = defaultdict(list)

    async def forward(self, peer: Peer, request: Forward, *, timeout: float) -> bytes:
        await self._answer(peer, timeout)
        return request.x

    async def backward(self, peer: Peer, request: Backward, *, timeout: float) -> bytes:
        await self._answer(peer, timeout)
        return request.grad

    async def _answer(self, peer: Peer, timeout: float) -> None:
        self.timeouts[peer].append(timeout)
        if peer in self.silent:
            await asyncio.wait_for(asyncio.Event().wait(), timeout)
        await asyncio.sleep(self.delay_s)


class EchoBackend:
    """A stage server's compute with no model, the backend a ``StageServicer`` calls: answers a forward with its input
    frame and a backward with its gradient (with ``reply_bytes``, that many bytes of ``fill`` either way), after
    ``delay_s`` (None: never, as a server that computes forever) and once ``gate`` is set (``held``: clear at the start).
    ``raise_next`` is raised by the next call instead of answering, ``fail`` by every call; ``calls`` counts the calls
    made (held ones included), and ``info()`` is ``info``."""

    def __init__(
        self,
        *,
        reply_bytes: int | None = None,
        fill: bytes = b"\x00",
        delay_s: float | None = 0.0,
        held: bool = False,
        info: Mapping[str, object] | None = None,
    ) -> None:
        self.reply_bytes, self.fill, self.delay_s, self._info = reply_bytes, fill, delay_s, dict(info or {})
        self.gate = asyncio.Event()
        if not held:
            self.gate.set()
        self.raise_next: Exception | None = None
        self.fail: Exception | None = None
        self.calls = 0

    async def forward(self, peer: object, request: Forward) -> bytes:
        return await self._answer(request.x)

    async def backward(self, peer: object, request: Backward) -> bytes:
        return await self._answer(request.grad)

    def info(self) -> dict[str, object]:
        return dict(self._info)

    async def _answer(self, frame: bytes) -> bytes:
        self.calls += 1
        await self.gate.wait()
        if self.delay_s is None:
            await asyncio.Event().wait()
        elif self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.raise_next is not None:
            error, self.raise_next = self.raise_next, None
            raise error
        if self.fail is not None:
            raise self.fail
        return Reply(frame if self.reply_bytes is None else self.fill * self.reply_bytes)
