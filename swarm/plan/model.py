"""The throughput model: what a trainer's microbatch asks of every link and every stage, and the rate that follows.

A trainer calls each stage of its path in turn (``swarm/pipeline/trainer.py``): it sends stage s its input frame and
gets the stage's output back, then sends that output on to stage s + 1 (the same frame, relayed), and backward the
same way with gradients. So per microbatch and stage the trainer's uplink carries one activation frame and one
gradient frame, its downlink one of each, and stage s's server carries the mirror image. Each link direction, each
stage's compute and the trainer's own compute is a resource with a time per microbatch; with enough microbatches in
flight the slowest one sets the rate. The trainer keeps at most ``window`` in flight, and with ``max_staleness`` 0 it
drains its window at every inner step, so each step also pays one microbatch's whole round trip (the bubble).

``Swarm.route`` "relay" is the trainer's ``--relay`` (issue 43 §3, ``swarm/pipeline/relaying.py``): a path's frames
go server to server, so the trainer's link carries only the first stage's input and the last one's output (and their
gradients), the servers' links carry what they carry today, and a microbatch's frames cross S + 1 links each way
instead of 2·S; the trainer still calls every hop in turn (its control round trips), and each server's push to the
next is a call of its own.

    >>> frames = Frames.uniform(stages=2, activation=6_299_689, gradient=6_299_689)  # int8 frames of 8 × 1024 × 768
    >>> link = Link.symmetric(parse_rate("100mbit"))
    >>> swarm = Swarm(tokens=8192, frames=frames, compute=Compute(stages=(0.021, 0.021), trainer=0.0),
    ...               network=Network(trainer=link, server=link, rtt_s=0.05), window=16, microbatches_per_step=2,
    ...               max_staleness=1)
    >>> p = predict(swarm); round(p.tokens_per_s), p.bottleneck  # (3889, "the trainer's uplink")

Units: bytes, seconds, bytes per second (``Link``'s rates), tokens per microbatch ``tokens``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Literal

Route = Literal["trainer", "relay"]  # the trainer calls each stage in turn (today); frames go server to server

# What a link carries beyond the frames: TCP/IP headers (52 of every 1500 bytes with timestamps), Ethernet's 14 that
# the lab's tbf counts, libp2p's yamux and noise framing (12 + 16 bytes a frame of up to 64 KiB): ~4.5%.
WIRE_OVERHEAD = 1.045
# A server's backward needs its forward's graph; a server that cannot keep it recomputes the forward: 4/3 of the
# FLOPs (forward 1, backward 2, the recompute 1 more). Servers keep graphs by default (``--keep-graph-mb``).
RECOMPUTE_FACTOR = 4 / 3
BUBBLE_SHARE = 0.5  # a bottleneck busy under half of an inner step's time is no bottleneck: the step's bubble is


def parse_rate(text: str) -> float:
    """A link rate as bytes per second: ``100mbit``, ``1gbit``, ``20 Mbit/s``, ``500kbit``, ``12.5MB`` (bytes).

    >>> parse_rate("100mbit")  # 12500000.0
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(bit|b|bps|byte|bytes)?(/s)?\s*", text, re.IGNORECASE)
    if m is None or (m.group(3) is None and m.group(2) == ""):
        raise ValueError(f"a link rate is a number and a unit, e.g. 100mbit, 1gbit or 12.5MB; got {text!r}")
    value, prefix, unit = float(m.group(1)), m.group(2).lower(), (m.group(3) or "bit").lower()
    scale = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[prefix]
    bits = unit in ("bit", "bps") or (unit == "b" and m.group(3) == "b")  # "b" is a bit, "B" a byte
    if value <= 0:
        raise ValueError(f"a link rate must be positive, got {text!r}")
    return value * scale / 8 if bits else value * scale


def mbit(bytes_per_s: float) -> float:
    """Bytes per second as Mbit/s."""
    return bytes_per_s * 8 / 1e6


@dataclass(frozen=True, kw_only=True)
class Link:
    """One peer's access link: what it can send (``up``) and receive (``down``), bytes per second."""

    up: float
    down: float

    @classmethod
    def symmetric(cls, bytes_per_s: float) -> Link:
        return cls(up=bytes_per_s, down=bytes_per_s)

    def __post_init__(self) -> None:
        if not (self.up > 0 and self.down > 0):
            raise ValueError(f"link rates must be positive, got up {self.up}, down {self.down}")


@dataclass(frozen=True, kw_only=True)
class Frames:
    """The frames of one microbatch at stage s = 1..S (index s − 1), bytes as sent: ``into`` the stage's input
    activation, ``out`` its output, ``grad_into`` the gradient of its output (what its backward gets), ``grad_out``
    the gradient of its input (what it returns). A real swarm's frames of one codec differ by zstd's saving (the
    embedding's int8 codes repeat, a block's output hardly does); ``uniform`` is the codec's own size."""

    into: tuple[int, ...]
    out: tuple[int, ...]
    grad_into: tuple[int, ...]
    grad_out: tuple[int, ...]

    @classmethod
    def uniform(cls, *, stages: int, activation: int, gradient: int) -> Frames:
        return cls(
            into=(activation,) * stages,
            out=(activation,) * stages,
            grad_into=(gradient,) * stages,
            grad_out=(gradient,) * stages,
        )

    def __post_init__(self) -> None:
        if not len(self.into) == len(self.out) == len(self.grad_into) == len(self.grad_out) >= 1:
            raise ValueError("frames need one entry per stage in each of into, out, grad_into, grad_out")

    @property
    def stages(self) -> int:
        return len(self.into)

    @property
    def trainer_sent(self) -> int:
        """The trainer's uplink per microbatch: every stage's input and its output's gradient."""
        return sum(self.into) + sum(self.grad_into)

    @property
    def trainer_received(self) -> int:
        """The trainer's downlink per microbatch: every stage's output and its input's gradient."""
        return sum(self.out) + sum(self.grad_out)

    def trainer_link(self, route: Route) -> tuple[int, int]:
        """The trainer's (sent, received) bytes per microbatch: every stage's frames when it calls each in turn, the
        path's ends only when frames go server to server."""
        if route == "trainer":
            return self.trainer_sent, self.trainer_received
        return self.into[0] + self.grad_into[-1], self.out[-1] + self.grad_out[0]

    def server_received(self, stage: int) -> int:
        return self.into[stage - 1] + self.grad_into[stage - 1]

    def server_sent(self, stage: int) -> int:
        return self.out[stage - 1] + self.grad_out[stage - 1]


@dataclass(frozen=True, kw_only=True)
class Compute:
    """Seconds of compute per microbatch: each stage server's forward + backward (``stages``, index s − 1, its frames'
    decoding and encoding included), the trainer's embedding, head, loss and codecs (``trainer``), and the trainer's
    optimizer step once per inner step (``inner_step``)."""

    stages: tuple[float, ...]
    trainer: float
    inner_step: float = 0.0


@dataclass(frozen=True, kw_only=True)
class Network:
    """The links: the trainer's, every stage server's (one for all, as the lab caps them), the round trip between the
    trainer and a server, and a fixed cost per RPC beyond it (serialisation, the libp2p daemon)."""

    trainer: Link
    server: Link
    rtt_s: float = 0.0
    call_overhead_s: float = 0.0
    overhead: float = WIRE_OVERHEAD  # wire bytes per frame byte


@dataclass(frozen=True, kw_only=True)
class Swarm:
    """What the model reads: one trainer's microbatch (``tokens`` of it), its frames, the compute, the network, and the
    trainer's window: at most ``window`` microbatches in flight, ``microbatches_per_step`` of them per inner step, the
    window drained at each step unless ``max_staleness`` > 0. ``trainers``: trainers sharing each stage's server (its
    link and compute serve them all). ``host_cores``: every peer on one machine with that many cores' worth of compute
    (the WAN lab; fewer than it has when others load it, or when its cores slow each other), whose compute then also
    queues for them; None for peers on machines of their own."""

    tokens: int
    frames: Frames
    compute: Compute
    network: Network
    window: int = 4
    microbatches_per_step: int = 1
    max_staleness: int = 0
    trainers: int = 1
    host_cores: float | None = None
    route: Route = "trainer"

    def __post_init__(self) -> None:
        if self.route not in ("trainer", "relay"):
            raise ValueError(f"route must be 'trainer' or 'relay', got {self.route!r}")
        if len(self.compute.stages) != self.frames.stages:
            raise ValueError(f"{len(self.compute.stages)} stage compute times for {self.frames.stages} stages")
        if min(self.tokens, self.window, self.microbatches_per_step, self.trainers) < 1 or self.max_staleness < 0:
            raise ValueError("tokens, window, microbatches_per_step and trainers must be ≥ 1, max_staleness ≥ 0")


@dataclass(frozen=True, kw_only=True)
class Resource:
    """One resource's work per microbatch: ``seconds`` of it, and for a link the ``bytes`` it carries and its rate."""

    name: str
    seconds: float
    bytes: int = 0
    rate: float | None = None  # bytes per second; None for compute


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """What ``predict`` finds: every resource's time per microbatch, one microbatch's round trip alone, the window in
    effect, the inner step's time, and the trainer's tokens per second with what limits it."""

    resources: tuple[Resource, ...]
    round_trip_s: float  # one microbatch through its whole path and back, nothing else in flight
    window: int  # microbatches in flight: the cap, or fewer when an inner step holds fewer
    step_s: float  # one inner step: its microbatches through the pipeline, the bubble and the optimizer step
    tokens_per_s: float  # of one trainer
    bottleneck: str
    microbatches_per_step: int

    @property
    def slowest(self) -> Resource:
        return max(self.resources, key=lambda r: r.seconds)

    def busy(self, resource: Resource) -> float:
        """The fraction of an inner step ``resource`` works."""
        return self.microbatches_per_step * resource.seconds / self.step_s

    def resource(self, name: str) -> Resource:
        return next(r for r in self.resources if r.name == name)


def resources(swarm: Swarm) -> tuple[Resource, ...]:
    """Every resource's time per microbatch of one trainer (a server's shared by ``trainers`` trainers counts theirs)."""
    f, c, net, k = swarm.frames, swarm.compute, swarm.network, swarm.trainers
    sent, received = f.trainer_link(swarm.route)
    out = [
        link_resource("the trainer's uplink", sent, net.trainer.up, net.overhead),
        link_resource("the trainer's downlink", received, net.trainer.down, net.overhead),
        Resource(name="the trainer's compute", seconds=c.trainer + c.inner_step / swarm.microbatches_per_step),
    ]
    for s in range(1, f.stages + 1):
        out += [
            link_resource(f"stage {s}'s uplink", k * f.server_sent(s), net.server.up, net.overhead),
            link_resource(f"stage {s}'s downlink", k * f.server_received(s), net.server.down, net.overhead),
            Resource(name=f"stage {s}'s compute", seconds=k * c.stages[s - 1]),
        ]
    if swarm.host_cores is not None:  # one machine's cores run every peer's compute
        total = c.trainer * k + c.inner_step * k / swarm.microbatches_per_step + k * sum(c.stages)
        out.append(Resource(name=f"the host's {swarm.host_cores:.2g} cores", seconds=total / swarm.host_cores))
    return tuple(out)


def link_resource(name: str, nbytes: int, rate: float, overhead: float) -> Resource:
    return Resource(name=name, seconds=nbytes * overhead / rate, bytes=nbytes, rate=rate)


def round_trip_s(swarm: Swarm) -> float:
    """One microbatch alone: the trainer's compute, and per hop (S forward, S backward) a round trip, the call's fixed
    cost, the request's and the reply's transfer at the slower end of the link, and the server's compute; relayed,
    ``relayed_round_trip_s``."""
    f, c, net = swarm.frames, swarm.compute, swarm.network
    if swarm.route == "relay":
        return relayed_round_trip_s(swarm)
    to_server = min(net.trainer.up, net.server.down)  # the bytes cross both ends: the slower one paces them
    to_trainer = min(net.server.up, net.trainer.down)
    total = c.trainer
    for s in range(1, f.stages + 1):
        wire = net.overhead * ((f.into[s - 1] + f.grad_into[s - 1]) / to_server + f.server_sent(s) / to_trainer)
        total += 2 * (net.rtt_s + net.call_overhead_s) + wire + c.stages[s - 1]
    return total


def relayed_round_trip_s(swarm: Swarm) -> float:
    """``round_trip_s`` when frames go server to server, as ``--relay`` does it: the frames forward trainer → stage 1
    → … → stage S → trainer and backward the other way, each at the slower of its sender's uplink and its receiver's
    downlink; per direction S calls from the trainer (a round trip and a call's cost each: control, in sequence) and
    S − 1 pushes from server to server (each a call of its own, which the sender's reply waits for)."""
    f, c, net = swarm.frames, swarm.compute, swarm.network
    first = min(net.trainer.up, net.server.down)  # the trainer's frame to the path's first (or last) server
    between = min(net.server.up, net.server.down)
    last = min(net.server.up, net.trainer.down)
    forward = (f.into[0] / first, *(f.out[s] / between for s in range(f.stages - 1)), f.out[-1] / last)
    backward = (f.grad_into[-1] / first, *(f.grad_out[s] / between for s in range(1, f.stages)), f.grad_out[0] / last)
    calls = 2 * (f.stages + f.stages - 1)  # the trainer's calls and the servers' pushes, both directions
    wire = net.overhead * (sum(forward) + sum(backward))
    return c.trainer + sum(c.stages) + calls * (net.rtt_s + net.call_overhead_s) + wire


def predict(swarm: Swarm, *, steps: int | None = None) -> Prediction:
    """The tokens per second of one trainer, and what limits it: in the long run, or over a run of ``steps`` inner
    steps from the trainer's start (whose window starts at 1: the first microbatch goes alone, the first step takes
    one round trip more).

    The pipeline delivers a microbatch every ``max(resource times)`` while the window keeps it full, and no faster
    than ``window`` microbatches per round trip (Little's law). With ``max_staleness`` 0 the window stays within an
    inner step: n microbatches take one round trip for the first and then one interval each, ``L + (n − 1) / rate``,
    plus the optimizer step.
    """
    res = resources(swarm)
    slowest = max(res, key=lambda r: r.seconds)
    latency = round_trip_s(swarm)
    n = swarm.microbatches_per_step
    window = swarm.window if swarm.max_staleness > 0 else min(swarm.window, n)
    interval = max(slowest.seconds, latency / window)  # seconds between microbatches once the pipeline is full
    if swarm.max_staleness > 0:  # the window spans inner steps: no bubble, the optimizer step is the trainer's compute
        step_s = n * interval
    else:
        step_s = latency + (n - 1) * interval + swarm.compute.inner_step
    tokens_per_s = n * swarm.tokens / step_s
    if steps is not None:  # the window's start: the first microbatch alone, then the pipeline as above
        first_s = step_s + (latency - interval if n > 1 else 0.0)
        tokens_per_s = steps * n * swarm.tokens / (first_s + (steps - 1) * step_s)
    if latency / window > slowest.seconds:
        bottleneck = f"the window: {window} microbatch(es) in flight over a {latency:.3g} s round trip"
    elif n * slowest.seconds < BUBBLE_SHARE * step_s:
        bottleneck = f"the bubble: each inner step's {n} microbatch(es) wait for a {latency:.3g} s round trip"
    else:
        bottleneck = slowest.name
    return Prediction(
        resources=res,
        round_trip_s=latency,
        window=window,
        step_s=step_s,
        tokens_per_s=tokens_per_s,
        bottleneck=bottleneck,
        microbatches_per_step=n,
    )


def with_links(swarm: Swarm, *, trainer: Link | None = None, server: Link | None = None) -> Swarm:
    """The same swarm over other links (a what-if)."""
    net = replace(swarm.network, trainer=trainer or swarm.network.trainer, server=server or swarm.network.server)
    return replace(swarm, network=net)


def fix(swarm: Swarm, prediction: Prediction) -> tuple[str, Prediction]:
    """What to change about the bottleneck, and the prediction once it is changed: a link at the faster of its other
    direction's rate and 10× its own, a stage served by twice the replicas, or a window spanning inner steps."""
    name, net = prediction.bottleneck, swarm.network
    if name.startswith(("the window", "the bubble")):
        better = replace(swarm, max_staleness=max(1, swarm.max_staleness))
        what = (
            "let the window span inner steps (--max-staleness 1, at a quality cost) or put more microbatches in a step"
        )
        if name.startswith("the window"):
            better = replace(better, window=math.ceil(prediction.round_trip_s / prediction.slowest.seconds))
            what = f"keep {better.window} microbatches in flight (--in-flight {better.window}, --max-staleness 1)"
        return what, predict(better)
    if name.endswith(("uplink", "downlink")):
        up = name.endswith("uplink")
        link = net.trainer if name.startswith("the trainer") else net.server
        own, other = (link.up, link.down) if up else (link.down, link.up)
        rate = max(other, 10 * own)
        faster = replace(link, up=rate) if up else replace(link, down=rate)
        better = with_links(swarm, **({"trainer": faster} if name.startswith("the trainer") else {"server": faster}))
        return f"{'up' if up else 'down'} at {mbit(rate):g} Mbit/s", predict(better)
    if name.startswith("stage "):
        stage = int(name.split()[1].rstrip("'s"))
        halved = tuple(t / 2 if s == stage else t for s, t in enumerate(swarm.compute.stages, start=1))
        better = replace(swarm, compute=replace(swarm.compute, stages=halved))
        return f"a second replica of stage {stage} (or a device twice as fast)", predict(better)
    c = swarm.compute
    if name.startswith("the host"):  # the lab's shared cores: twice as many
        return f"{2 * (swarm.host_cores or 1)} cores", predict(replace(swarm, host_cores=2 * (swarm.host_cores or 1)))
    quicker = replace(c, trainer=c.trainer / 2, inner_step=c.inner_step / 2)
    return "a device twice as fast for the trainer", predict(replace(swarm, compute=quicker))
