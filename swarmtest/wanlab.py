"""WAN lab: peers in network namespaces on a private bridge, each behind its own bandwidth cap (``tc tbf``
on both ends of its veth) and round-trip delay (a user-space delay line); no route leads out of the lab's subnet.
Closing the lab deletes its namespaces; a crashed owner's are removed by the next lab or ``scripts/wanlab.py
cleanup``. Needs root and iproute2. How it works: docs/architecture.md, "WAN lab"; its command line: scripts/wanlab.py.

    with WanLab(caps_mbit=[20, 20, 100], rtts_ms=[100, 100, 0]) as lab:
        server = lab.spawn(2, ["python", "-m", "http.server", "--bind", lab.hosts[2].address])
        lab.run(0, ["python", "-c", "..."])  # reaches http://10.77.0.3:8000 at up to 20 Mbit/s
        ping_ms(lab, 0, 1)  # ~100 (ICMP echo round trips, median)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import ipaddress
import json
import os
import re
import select
import shutil
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from types import FrameType
from typing import Any

SUBNET = ipaddress.ip_network("10.77.0.0/24")
# for labs whose peers must look public to libp2p: go-libp2p announces circuits only through a relay's public
# addresses. 11.0.0.0/8 is neither private nor reserved; the lab's namespaces have no route out, so nothing leaves
PUBLIC_SUBNET = ipaddress.ip_network("11.77.0.0/24")
NAME_ROOT = "slab"
OWNED_NAME = re.compile(rf"^{NAME_ROOT}(\d+)-")  # slab<owner pid>-…, the default prefix
PROBE_PORT = 5201
SLOW_START_RTTS = 20  # round trips a delayed probe sends before the sink counts: TCP's ramp to a full path
SOURCE_SNDBUF = 256 * 1024  # the probe's send buffer on a path without delay: bounds its drain after sending
# tbf: the bucket must hold a few ms at the rate (and a full-size packet), or the rate sags below
# the cap; the queue in front of it holds 50 ms at the rate, like a modest home router.
BURST_S, MIN_BURST_BYTES, QUEUE_MS = 0.004, 16 * 1024, 50
MAX_RTT_MS = 10_000.0
# AF_PACKET socket options (linux/if_packet.h) and the socket buffer overrides root may set (asm/socket.h)
SOL_PACKET, PACKET_VNET_HDR, PACKET_IGNORE_OUTGOING, ETH_P_ALL = 263, 15, 23, 0x0003
SO_SNDBUFFORCE, SO_RCVBUFFORCE = 32, 33
FRAME_MAX = 10 + 65536 + 1024  # virtio-net header + the largest offload frame, with room to spare
DELAY_QUEUE_MAX_BYTES = 64 << 20  # per direction: beyond this the delay line drops, like a full router queue


class WanLabError(RuntimeError):
    """A command the lab needs failed, or the machine cannot host a lab."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Host:
    """One lab host: its namespace, its address on the lab bridge, its cap (None: uncapped), its link's round-trip delay."""

    index: int
    netns: str
    address: str
    cap_mbit: float | None
    rtt_ms: float = 0.0


def sh(*argv: str) -> str:
    """Run one iproute2 command; its stdout, or WanLabError with its stderr."""
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise WanLabError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or f'exit status {done.returncode}'}")
    return done.stdout


def unsupported_reason() -> str | None:
    """Why this machine cannot host a lab (not root, no iproute2, no netns/veth/bridge/tbf), or None."""
    if os.geteuid() != 0:
        return "the WAN lab needs root (network namespaces and tc): run it with sudo"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the WAN lab needs iproute2 (`ip`, `tc`): apt-get install -y iproute2"
    probe = f"{NAME_ROOT}{os.getpid()}-probe"  # named like a lab, so a crash here is cleaned up too
    try:
        sh("ip", "netns", "add", probe)
        sh("ip", "-n", probe, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", probe, "link", "add", "v0", "type", "veth", "peer", "name", "v1")
        sh("tc", "-n", probe, "qdisc", "add", "dev", "v0", "root", *tbf(20))
    except WanLabError as e:
        return f"this machine cannot host a WAN lab (network namespaces, veth, bridge and tc tbf are needed): {e}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def tbf(mbit: float) -> list[str]:
    """The ``tc`` arguments of a token bucket at ``mbit`` Mbit/s."""
    burst = max(MIN_BURST_BYTES, int(mbit * 1e6 / 8 * BURST_S))
    return ["tbf", "rate", f"{round(mbit * 1000)}kbit", "burst", str(burst), "latency", f"{QUEUE_MS}ms"]


def lab_namespaces(prefix: str) -> list[str]:
    """Every namespace whose name starts with ``prefix``."""
    listing = sh("ip", "-j", "netns", "list").strip()
    return [ns["name"] for ns in json.loads(listing or "[]") if ns["name"].startswith(prefix)]


def remove_namespaces(names: Sequence[str], grace_s: float = 5.0) -> None:
    """SIGTERM every process inside ``names``, SIGKILL what outlives ``grace_s``, then delete the namespaces (and their links)."""

    def pids() -> list[int]:
        return [int(p) for ns in names for p in sh("ip", "netns", "pids", ns).split()]

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while pids() and time.monotonic() < deadline:
            time.sleep(0.05)
    for ns in names:
        sh("ip", "netns", "del", ns)


def cleanup(prefix: str | None = None) -> list[str]:
    """Remove the namespaces starting with ``prefix``; with none, those of labs whose owner process is gone. Returns their names."""
    if prefix is None:
        names = [
            ns for ns in lab_namespaces(NAME_ROOT) if (m := OWNED_NAME.match(ns)) and not pid_alive(int(m.group(1)))
        ]
    else:
        names = lab_namespaces(prefix)
    remove_namespaces(names)
    return names


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class WanLab:
    """A bridge and one namespace per cap; a context manager that always takes it all down.

    ``caps_mbit[i]`` caps host i in each direction (None: uncapped); ``rtts_ms[i]`` (default: all
    0) is the round-trip delay host i's link adds, half of it on the way out and half on the way
    back, a quarter in each direction of host i's link (see the module's docstring). ``prefix``
    names the namespaces (``{prefix}hub``, ``{prefix}p{i}``); leftovers with the same prefix are
    removed first, so give each concurrent lab its own. Host i has address ``subnet[i + 1]`` (default
    ``SUBNET``, private; ``PUBLIC_SUBNET`` where libp2p must take the hosts for public ones).
    """

    def __init__(
        self,
        *,
        caps_mbit: Sequence[float | None],
        rtts_ms: Sequence[float] | None = None,
        prefix: str | None = None,
        grace_s: float = 5.0,
        subnet: ipaddress.IPv4Network = SUBNET,
    ) -> None:
        if not 1 <= len(caps_mbit) <= subnet.num_addresses - 3:
            raise ValueError(f"a lab has 1 to {subnet.num_addresses - 3} hosts, got {len(caps_mbit)}")
        for cap in caps_mbit:
            check_cap(cap)
        rtts_ms = [0.0] * len(caps_mbit) if rtts_ms is None else list(rtts_ms)
        if len(rtts_ms) != len(caps_mbit):
            raise ValueError(f"rtts_ms has {len(rtts_ms)} values for {len(caps_mbit)} hosts")
        for rtt in rtts_ms:
            check_rtt(rtt)
        self.prefix = prefix or f"{NAME_ROOT}{os.getpid()}-"
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", self.prefix):
            raise ValueError(f"prefix {self.prefix!r}: use up to 64 letters, digits, '_', '.', '-'")
        self.hub = f"{self.prefix}hub"
        self.hosts = [
            Host(index=i, netns=f"{self.prefix}p{i}", address=str(subnet[i + 1]), cap_mbit=cap, rtt_ms=rtt)
            for i, (cap, rtt) in enumerate(zip(caps_mbit, rtts_ms, strict=True))
        ]
        self.subnet = subnet
        self.grace_s = grace_s
        self._no_inbound: set[int] = set()  # hosts behind a firewall that lets no connection in
        self._procs: list[subprocess.Popen] = []
        self._sigterm: Any = None
        self._open = False

    def __enter__(self) -> WanLab:
        reason = unsupported_reason()
        if reason is not None:
            raise WanLabError(reason)
        cleanup()  # leftovers of crashed labs
        cleanup(self.prefix)
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and threading.current_thread() is threading.main_thread():
            self._sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so SIGTERM unwinds through __exit__
        self._open = True
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        sh("ip", "netns", "add", self.hub)
        sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        for host in self.hosts:
            sh("ip", "netns", "add", host.netns)
            sh("ip", "-n", host.netns, "link", "set", "lo", "up")  # hivemind's daemon listens on loopback
            port = f"p{host.index}"  # the bridge end; the host's end is eth0 in its namespace
            sh("ip", "-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
            sh("ip", "-n", host.netns, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", "eth0")
            sh("ip", "-n", host.netns, "link", "set", "eth0", "up")
            if host.rtt_ms > 0:
                self._delay(host)
            else:
                sh("ip", "-n", self.hub, "link", "set", port, "master", "br0", "up")
            self._shape(host.index, host.cap_mbit)

    def _delay(self, host: Host) -> None:
        """Put a delay line between host's bridge end ``p{i}`` and the bridge (via the veth pair ``d{i}``-``b{i}``)."""
        port, inner, outer = f"p{host.index}", f"d{host.index}", f"b{host.index}"
        sh("ip", "-n", self.hub, "link", "add", inner, "type", "veth", "peer", "name", outer)
        sh("ip", "-n", self.hub, "link", "set", outer, "master", "br0", "up")
        for dev in (inner, port):
            sh("ip", "-n", self.hub, "link", "set", dev, "up")
        argv = [
            sys.executable,
            os.path.abspath(__file__),
            "delayline",
            port,
            inner,
            "--delay-ms",
            f"{host.rtt_ms / 4:g}",
        ]
        line = self._spawn_in(self.hub, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready, _, _ = select.select([line.stdout], [], [], 20.0)
        if not ready or line.stdout.readline().strip() != "ready":
            line.kill()
            raise WanLabError(f"the delay line of host {host.index} did not start: {line.stderr.read().strip()}")

    def _shape(self, i: int, mbit: float | None) -> None:
        own, bridge = (self.hosts[i].netns, "eth0"), (self.hub, f"p{i}")  # what host i sends, what it receives
        for ns, dev in (own, bridge):
            if (ns, dev) == own and i in self._no_inbound:
                self._firewall(ns, dev, mbit)
            elif mbit is None:
                subprocess.run(
                    ["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True
                )  # fails if uncapped already
            else:
                sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf(mbit))

    @staticmethod
    def _firewall(ns: str, dev: str, mbit: float | None) -> None:
        """``dev`` sends no TCP SYN-ACK (class 1:1 queues nothing: every packet put there is dropped) and the rest at
        ``mbit`` (class 1:2, the default); u32 reads the TCP flags at byte 33, after a 20-byte IPv4 header."""
        subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True)
        sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "2")
        for minor in (1, 2):  # htb's own rates stay out of the way: the leaf below shapes
            sh(
                "tc",
                "-n",
                ns,
                "class",
                "add",
                "dev",
                dev,
                "parent",
                "1:",
                "classid",
                f"1:{minor}",
                "htb",
                "rate",
                "100gbit",
            )
        sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "pfifo", "limit", "0")
        leaf = tbf(mbit) if mbit is not None else ["pfifo", "limit", "1000"]
        sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:2", *leaf)
        syn_ack = ["match", "ip", "protocol", "6", "0xff", "match", "u8", "0x12", "0x12", "at", "33"]
        sh(
            "tc",
            "-n",
            ns,
            "filter",
            "add",
            "dev",
            dev,
            "parent",
            "1:",
            "protocol",
            "ip",
            "prio",
            "1",
            "u32",
            *syn_ack,
            "classid",
            "1:1",
        )

    def block_inbound(self, i: int) -> None:
        """From now on no connection to host i completes; the ones it opens (and those open already) still work."""
        self._no_inbound.add(i)
        self._shape(i, self.hosts[i].cap_mbit)

    def set_cap(self, i: int, mbit: float | None) -> None:
        """Change host i's cap (both directions) while the lab runs; None removes it."""
        check_cap(mbit)
        self._shape(i, mbit)
        self.hosts[i] = dataclasses.replace(self.hosts[i], cap_mbit=mbit)

    def command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside host i's namespace, for callers that start processes themselves."""
        return ["ip", "netns", "exec", self.hosts[i].netns, *argv]

    def spawn(self, i: int, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` in host i (its own session, so a terminal's Ctrl+C reaches only the lab, which stops it)."""
        return self._spawn_in(self.hosts[i].netns, argv, **popen_kwargs)

    def _spawn_in(self, netns: str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
        popen_kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(["ip", "netns", "exec", netns, *argv], **popen_kwargs)
        self._procs.append(proc)
        return proc

    def run(self, i: int, argv: Sequence[str], **run_kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` in host i to completion (``subprocess.run`` keywords)."""
        return subprocess.run(self.command(i, argv), **run_kwargs)

    def close(self) -> None:
        """Stop every process in the lab and delete its namespaces; idempotent. Ctrl+C waits until it is done."""
        if not self._open:
            return
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            remove_namespaces(lab_namespaces(self.prefix), self.grace_s)
            for proc in self._procs:
                proc.kill()  # a no-op: every process in the namespaces is gone by now, and this reaps it
                proc.wait()
            self._open = False
            if self._sigterm is not None:
                signal.signal(signal.SIGTERM, self._sigterm)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def check_cap(mbit: float | None) -> None:
    if mbit is not None and not 0.01 <= mbit <= 100_000:
        raise ValueError(f"a cap is between 0.01 and 100000 Mbit/s (or None), got {mbit}")


def check_rtt(ms: float) -> None:
    if not 0 <= ms <= MAX_RTT_MS:
        raise ValueError(f"a round-trip delay is between 0 and {MAX_RTT_MS:g} ms, got {ms}")


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


# --- delay line: frames between two interfaces, each held for a fixed time ---


def packet_socket(dev: str) -> socket.socket:
    """A non-blocking ``AF_PACKET`` socket on ``dev`` for every frame it receives (not those it sends), with a
    virtio-net header, so an offload frame crosses whole, checksum state and all; big buffers, set as root."""
    sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)  # what arrives while this process is descheduled
    sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 8 << 20)  # what waits in the cap's tbf on the way out
    sock.bind((dev, ETH_P_ALL))
    sock.setblocking(False)
    return sock


def delay_line(dev_a: str, dev_b: str, delay_s: float, *, ready: Any = None) -> None:
    """Forward every frame from ``dev_a`` to ``dev_b`` and back, each ``delay_s`` after it arrived; runs until killed.

    One thread, one epoll: a frame is read as soon as it arrives and queued with its due time;
    a constant delay keeps each direction's queue in arrival order, so the head is always the
    next due. epoll sleeps in whole milliseconds (rounded up), so a frame leaves at most ~1 ms
    late (plus scheduling on a loaded machine). A frame the outgoing interface refuses (its cap's
    queue is full) or that finds ``DELAY_QUEUE_MAX_BYTES`` queued is dropped, as a router would.
    """
    socks = [packet_socket(dev_a), packet_socket(dev_b)]
    queues: list[collections.deque[tuple[float, bytes]]] = [collections.deque(), collections.deque()]
    queued = [0, 0]
    poller = select.epoll()
    for sock in socks:
        poller.register(sock.fileno(), select.EPOLLIN)
    side_of = {sock.fileno(): side for side, sock in enumerate(socks)}
    if ready is not None:
        ready()
    while True:
        now = time.monotonic()
        for side, queue in enumerate(queues):  # frames read from side go out of the other side
            while queue and queue[0][0] <= now:
                frame = queue.popleft()[1]
                queued[side] -= len(frame)
                try:
                    socks[1 - side].send(frame)
                except OSError:  # ENOBUFS (tbf full), EAGAIN (send buffer full): dropped
                    pass
        heads = [queue[0][0] for queue in queues if queue]
        for fd, _ in poller.poll(max(0.0, min(heads) - now) if heads else None):
            side = side_of[fd]
            due = time.monotonic() + delay_s
            while True:
                try:
                    frame = socks[side].recv(FRAME_MAX)
                except BlockingIOError:
                    break
                if queued[side] + len(frame) <= DELAY_QUEUE_MAX_BYTES:
                    queues[side].append((due, frame))
                    queued[side] += len(frame)


# --- round-trip probe: ICMP echo from one host to another (no ping binary needed) ---


def icmp_checksum(data: bytes) -> int:
    data += b"\0" * (len(data) % 2)
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    return ~(total + (total >> 16)) & 0xFFFF


def echo_rtts_ms(address: str, count: int, timeout_s: float = 5.0) -> list[float]:
    """Round trips of ``count`` ICMP echo requests to ``address``, one after another, in ms (raw socket: root)."""
    ident, rtts = os.getpid() & 0xFFFF, []
    with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as sock:
        sock.settimeout(timeout_s)
        for seq in range(count):
            payload = bytes(32)
            header = struct.pack("!BBHHH", 8, 0, 0, ident, seq)  # echo request
            header = struct.pack("!BBHHH", 8, 0, icmp_checksum(header + payload), ident, seq)
            start = time.monotonic()
            sock.sendto(header + payload, (address, 0))
            while True:  # the raw socket sees every ICMP message of the namespace: wait for our reply
                reply = sock.recv(2048)
                ihl = (reply[0] & 0x0F) * 4
                kind, _, _, their_ident, their_seq = struct.unpack("!BBHHH", reply[ihl : ihl + 8])
                if kind == 0 and (their_ident, their_seq) == (ident, seq):
                    break
            rtts.append((time.monotonic() - start) * 1000)
    return rtts


def ping_ms(lab: WanLab, src: int, dst: int, *, count: int = 10) -> float:
    """Median ICMP round trip from host ``src`` to host ``dst`` in ms, after one echo that resolves the neighbour (ARP)."""
    argv = [sys.executable, os.path.abspath(__file__), "ping", lab.hosts[dst].address, "--count", str(count + 1)]
    done = lab.run(src, argv, capture_output=True, text=True, timeout=30 + count * 2 * MAX_RTT_MS / 1000)
    if done.returncode != 0:
        raise WanLabError(f"ping from host {src} to host {dst} failed: {done.stderr.strip()}")
    return statistics.median(json.loads(done.stdout)[1:])


# --- bandwidth probe: a TCP sink in one host, a timed source in another ---


def measure_mbit(lab: WanLab, src: int, dst: int, *, seconds: float = 1.5) -> float:
    """TCP goodput from host ``src`` to host ``dst`` over ``seconds`` of sending, in Mbit/s.

    On a path with delay, TCP's slow start takes some round trips to fill it: the sender sends
    ``SLOW_START_RTTS`` round trips longer, and the sink does not count them."""
    me = os.path.abspath(__file__)
    caps = [c for c in (lab.hosts[src].cap_mbit, lab.hosts[dst].cap_mbit) if c is not None]
    rtt_s = (lab.hosts[src].rtt_ms + lab.hosts[dst].rtt_ms) / 2 / 1000
    window = (min(caps) if caps else 1000.0) * 1e6 / 8 * rtt_s  # the bytes in flight that keep the path full
    warmup_s = SLOW_START_RTTS * rtt_s
    sink = lab.spawn(
        dst,
        [sys.executable, me, "sink", "--port", str(PROBE_PORT), "--skip-s", str(warmup_s)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        lab.run(
            src,
            [
                sys.executable,
                me,
                "source",
                lab.hosts[dst].address,
                "--port",
                str(PROBE_PORT),
                "--seconds",
                str(seconds + warmup_s),
                "--sndbuf",
                str(int(min(16 << 20, max(SOURCE_SNDBUF, 2 * window)))),
            ],
            check=True,
            timeout=seconds + warmup_s + 30,
        )
        out, _ = sink.communicate(timeout=30)
    finally:
        sink.kill()
    return json.loads(out)["mbit"]


def sink(port: int, timeout_s: float = 15.0, skip_s: float = 0.0) -> dict[str, float]:
    """Accept one connection, read it to EOF; bytes, and goodput from ``skip_s`` after its first byte to EOF."""
    with socket.create_server(("0.0.0.0", port)) as server:
        server.settimeout(timeout_s)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(timeout_s)
            buf = bytearray(1 << 20)
            n = conn.recv_into(buf)
            start, total, counting = time.monotonic() + skip_s, 0, skip_s <= 0
            while n:
                if not counting and time.monotonic() >= start:
                    counting, start = True, time.monotonic()
                total += n if counting else 0
                n = conn.recv_into(buf)
            seconds = time.monotonic() - start
    if not counting or seconds <= 0:
        raise WanLabError(f"the transfer ended within the {skip_s:g} s not counted")
    return {"bytes": total, "seconds": seconds, "mbit": total * 8 / seconds / 1e6}


def source(address: str, port: int, seconds: float, sndbuf: int = SOURCE_SNDBUF) -> None:
    """Send zeros to a sink for ``seconds``, then wait until it has read them all.

    ``sndbuf`` bounds the drain after ``seconds``; it must hold the path's bytes in flight (rate × round trip)."""
    deadline = time.monotonic() + 10.0
    while True:  # the sink may not be listening yet
        try:
            conn = socket.socket()
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
            conn.connect((address, port))
            break
        except ConnectionRefusedError:
            conn.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with conn:
        chunk, end = bytes(64 * 1024), time.monotonic() + seconds
        while time.monotonic() < end:
            conn.sendall(chunk)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1)  # EOF once the sink has everything


def selftest(
    caps_mbit: Sequence[float],
    *,
    rtts_ms: Sequence[float] | None = None,
    seconds: float = 1.5,
    tolerance: float = 0.15,
    rtt_tolerance: float = 0.2,
) -> bool:
    """Measure every capped host's upload and download, and its ping, against an extra uncapped host without
    delay (so the round trip expected is half the host's ``rtts_ms``); print a table."""
    rtts_ms = [0.0] * len(caps_mbit) if rtts_ms is None else list(rtts_ms)
    with WanLab(caps_mbit=[*caps_mbit, None], rtts_ms=[*rtts_ms, 0.0]) as lab:
        ref = len(caps_mbit)
        print(
            f"{'host':<6}{'address':<12}{'cap':>8}{'up':>9}{'down':>9}{'rtt':>8}{'ping':>8}"
            f"  (Mbit/s, TCP goodput, {seconds:g} s each; ms to the reference host, ICMP median)"
        )
        ok = True
        for host in lab.hosts[:ref]:
            up, down = (
                measure_mbit(lab, host.index, ref, seconds=seconds),
                measure_mbit(lab, ref, host.index, seconds=seconds),
            )
            expected_rtt, ping = host.rtt_ms / 2, ping_ms(lab, host.index, ref)
            good = all(abs(m / host.cap_mbit - 1) <= tolerance for m in (up, down))
            good &= rtt_within(ping, expected_rtt, rtt_tolerance)
            ok &= good
            print(
                f"{host.index:<6}{host.address:<12}{host.cap_mbit:>8g}{up:>9.1f}{down:>9.1f}{expected_rtt:>8g}{ping:>8.1f}"
                f"  {'ok' if good else 'OFF'}"
            )
    return ok


def rtt_within(measured_ms: float, expected_ms: float, tolerance: float, slack_ms: float = 1.0) -> bool:
    """Whether a measured round trip is within ``tolerance`` of the expected one; ``slack_ms`` covers the
    stack's own round trip and the delay line's millisecond timer."""
    return abs(measured_ms - expected_ms) <= tolerance * expected_ms + slack_ms


# --- CLI ---


def parse_caps(text: str, peers: int | None) -> list[float | None]:
    """``"20,none,100"`` as caps; one cap is repeated ``peers`` times."""
    caps = per_host(text, peers, "--caps", lambda c: None if c.strip().lower() == "none" else float(c))
    for cap in caps:
        check_cap(cap)
    return caps


def parse_rtts(text: str, peers: int) -> list[float]:
    """``"100,0,40"`` as round-trip delays in ms; one value is repeated ``peers`` times."""
    rtts = per_host(text, peers, "--rtt-ms", float)
    for rtt in rtts:
        check_rtt(rtt)
    return rtts


def per_host(text: str, peers: int | None, option: str, parse: Any) -> list:
    """A comma-separated value per host; one value is repeated ``peers`` times."""
    try:
        values = [parse(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{option} {text!r}: give numbers separated by commas") from None
    if peers is not None and len(values) == 1:
        values *= peers
    if peers is not None and len(values) != peers:
        raise ValueError(f"{option} lists {len(values)} values for {peers} hosts")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    # The command owns its signals: a parent may have left SIGINT/SIGTERM blocked or ignored (both survive exec),
    # and a lab that ignores them is never taken down.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # Python then never installed its KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="{check,up,run,selftest,cleanup}")
    sub.add_parser("check", help="say whether this machine can host a lab")
    for name, help in (
        ("up", "build a lab, print its hosts, hold it until Ctrl+C"),
        ("run", "run a command in every host ({i}, {addr}, {addrs} are filled in) until all exit"),
        ("selftest", "measure each cap with TCP against an uncapped host"),
    ):
        p = sub.add_parser(name, help=help)
        p.add_argument(
            "--caps",
            default="20,100",
            help="Mbit/s per host, comma-separated ('none': uncapped); one value is repeated --peers times",
        )
        p.add_argument("--peers", type=int)
        p.add_argument(
            "--rtt-ms",
            default="0",
            help="round-trip delay each host's link adds, ms, comma-separated or one value for all; "
            "the round trip between hosts i and j is the mean of theirs",
        )
        if name == "run":
            p.add_argument("argv", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    p = sub.add_parser("cleanup", help="remove leftovers of crashed labs (or every namespace starting with --prefix)")
    p.add_argument("--prefix")
    p = sub.add_parser("sink")  # internal: the probe's two ends
    p.add_argument("--port", type=int, default=PROBE_PORT)
    p.add_argument("--skip-s", type=float, default=0.0)
    p = sub.add_parser("source")
    p.add_argument("address")
    p.add_argument("--port", type=int, default=PROBE_PORT)
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--sndbuf", type=int, default=SOURCE_SNDBUF)
    p = sub.add_parser("ping")
    p.add_argument("address")
    p.add_argument("--count", type=int, default=10)
    p = sub.add_parser("delayline")
    p.add_argument("dev_a")
    p.add_argument("dev_b")
    p.add_argument("--delay-ms", type=float, required=True)
    args = parser.parse_args(argv)

    if args.cmd == "sink":
        print(json.dumps(sink(args.port, skip_s=args.skip_s)))
        return 0
    if args.cmd == "source":
        source(args.address, args.port, args.seconds, args.sndbuf)
        return 0
    if args.cmd == "ping":
        print(json.dumps(echo_rtts_ms(args.address, args.count)))
        return 0
    if args.cmd == "delayline":
        delay_line(args.dev_a, args.dev_b, args.delay_ms / 1000, ready=lambda: print("ready", flush=True))
        return 0
    reason = unsupported_reason()
    if args.cmd == "check":
        print(reason or "ok: this machine can host a WAN lab (root, network namespaces, veth, bridge, tc tbf)")
        return int(reason is not None)
    if reason is not None:
        raise SystemExit(reason)
    if args.cmd == "cleanup":
        removed = cleanup(args.prefix)
        print(f"removed {len(removed)} namespace(s)" + "".join(f"\n  {ns}" for ns in removed))
        return 0
    try:
        caps = parse_caps(args.caps, args.peers)
        rtts = parse_rtts(args.rtt_ms, len(caps))
    except ValueError as e:
        parser.error(str(e))
    if args.cmd == "selftest" and None in caps:
        parser.error("selftest measures caps: give a number for every host")
    try:
        if args.cmd == "selftest":
            return int(not selftest(caps, rtts_ms=rtts))
        with WanLab(caps_mbit=caps, rtts_ms=rtts) as lab:
            for host in lab.hosts:
                cap = "uncapped" if host.cap_mbit is None else f"{host.cap_mbit:g} Mbit/s"
                print(
                    f"host {host.index}  {host.address:<11} {cap:<14} rtt {host.rtt_ms:<6g} ip netns exec {host.netns} CMD",
                    flush=True,
                )
            if args.cmd == "up":
                print("lab is up; Ctrl+C takes it down", flush=True)
                while True:
                    signal.pause()
            command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            if not command:
                raise SystemExit("run: give the command after --")
            addrs = ",".join(h.address for h in lab.hosts)
            procs = [
                lab.spawn(h.index, [a.format(i=h.index, addr=h.address, addrs=addrs) for a in command])
                for h in lab.hosts
            ]
            return max((proc.wait() for proc in procs), key=abs)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
