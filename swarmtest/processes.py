"""Swarms of real processes on loopback: ``swarmloco run`` peers, other commands, and cleanup of all they started.

    swarm = Swarm(tmp_path, tiny_config(stages=1, steps=30), child_processes)   # child_processes (conftest) stops whatever is left
    swarm.spawn("stage1-a", PeerConfig(role="stage", stage=1))   # the first peer creates the swarm
    swarm.spawn("trainer-0", PeerConfig(role="trainer", steps=30, data=[DATA]))
    swarm.wait("10 steps", lambda: any(r.step >= 10 for r in swarm.progress("trainer-0")), 120)
    (result,) = swarmloco(["status", *swarm.join, "--json"], children=child_processes)

Every process is started in its own process group and appended to the test's ``child_processes`` list; ``reap``
(the fixture's teardown) stops them and everything they started, whatever the test's outcome.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar, overload

import pytest

from peer.launch import REPO_ROOT, spawn_peer, stop_processes, wait_for_address
from swarm.config import SwarmConfig
from swarm.config_toml import save_config
from swarm.dht.membership import Membership
from swarm.dht.process import SwarmDHT
from swarm.events import E, Event, OuterRound, Progress, StateDownload, StateServed, TrainerProgress
from swarm.node.config import PeerConfig
from swarmtest.configs import LOOPBACK
from swarmtest.records import records

T = TypeVar("T")


def wait_until(what: str, check: Callable[[], T | None], timeout: float, *, explain: Callable[[], str] = str) -> T:
    """Poll ``check`` until it returns something true, and return that; fail the test with ``explain()`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{explain()}")
        time.sleep(0.1)
    return result


class Swarm:
    """Processes of one test swarm, each logging to ``out/<name>.log``; the first peer spawned creates the swarm from
    ``cfg`` (saved as ``out/swarm.toml``), the others join through it."""

    def __init__(self, out: Path, cfg: SwarmConfig, children: list[subprocess.Popen]) -> None:
        self.out, self.cfg, self.children = out, cfg, children
        self.procs: dict[str, subprocess.Popen] = {}
        self.ids: dict[str, str] = {}  # name → peer id, for peers waited on with ``ready``
        self.started: dict[str, float] = {}
        self.join: list[str] = []  # --initial-peers of the first peer
        self.gone: set[str] = set()  # killed or stopped by the test: their exit is no failure
        save_config(cfg, out / "swarm.toml")

    def spawn(self, name: str, peer: PeerConfig | None = None, *args: str) -> subprocess.Popen:
        """A ``swarmloco run`` peer of config ``peer`` (listening on loopback, writing to ``out``, one thread), then
        ``args`` (options that name files, as ``--credentials``); the first one creates the swarm, and is waited for
        until it prints its address."""
        peer = dataclasses.replace(peer or PeerConfig(), host_maddrs=[LOOPBACK], out=self.out, threads=1)
        self.started[name] = time.time()
        proc = spawn_peer(
            name, [*peer.to_argv(), *args, *(self.join or ["--config", str(self.out / "swarm.toml")])], self.out
        )
        self._register(name, proc)
        if not self.join:  # everyone else joins through the first peer
            self.ready(name)
        return proc

    def spawn_command(self, name: str, command: Sequence[str], cwd: Path = REPO_ROOT) -> subprocess.Popen:
        """Any other process of the test (a dashboard, a scripted peer), in its own process group, output to ``out/<name>.log``."""
        self.started[name] = time.time()
        with (self.out / f"{name}.log").open("w") as log:
            proc = subprocess.Popen(
                list(command), stdout=log, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True
            )
        self._register(name, proc)
        return proc

    def _register(self, name: str, proc: subprocess.Popen) -> None:
        self.procs[name] = proc
        self.children.append(proc)  # before anything can fail: the fixture stops it whatever happens next

    def ready(self, name: str) -> str:
        """Wait until the peer prints its address; that address."""
        maddr = wait_for_address(self.procs[name], self.out / f"{name}.log", 120)
        self.ids[name] = maddr.rsplit("/p2p/", 1)[1]
        self.join = self.join or ["--initial-peers", maddr]
        return maddr

    @overload
    def records(self, name: str) -> list[Progress]: ...
    @overload
    def records(self, name: str, kind: type[E]) -> list[E]: ...
    def records(self, name: str, kind: type[Event] = Progress) -> list[Event]:
        """The peer's JSONL events of ``kind`` (by default its progress records)."""
        return records(self.out, name, kind)

    def progress(self, name: str) -> list[TrainerProgress]:
        """The peer's trainer progress records."""
        return self.records(name, TrainerProgress)

    def rounds(self, name: str) -> list[OuterRound]:
        return [r for r in self.records(name, OuterRound) if r.outcome == "done"]

    def served(self, name: str) -> set[str]:
        return {r.sha256 for r in self.records(name, StateServed)}

    def log(self, name: str, chars: int = 3000) -> str:
        path = self.out / f"{name}.log"
        return path.read_text()[-chars:] if path.exists() else ""

    def logs(self, chars: int = 2000) -> str:
        return "\n".join(f"--- {name}\n{self.log(name, chars)}{self.outer_story(name)}" for name in self.procs)

    def outer_story(self, name: str, last: int = 12) -> str:
        """The peer's last ``last`` rounds and state downloads, one line each (its log says little of them): what a
        timed-out wait on a round needs to be read."""
        lines = []
        events = sorted([*self.records(name, OuterRound), *self.records(name, StateDownload)], key=lambda e: e.time)
        for r in events[-last:]:
            if isinstance(r, OuterRound):
                lines.append(f"round {r.round}: {r.outcome} with {r.contributors} ({r.reason or ''}) → {r.global_hash}")
            else:
                lines.append(f"download ({r.reason}) of round {r.outer_round} from {r.from_peer} in {r.download_s}s")
        return "".join(f"\n  {line}" for line in lines)

    def wait(self, what: str, check: Callable[[], T | None], timeout: float) -> T:
        """Poll ``check`` until it returns something true; fail with every log if it times out or a live peer dies."""

        def alive_then_check() -> T | None:
            for name, proc in self.procs.items():
                assert proc.poll() in (None, 0) or name in self.gone, (
                    f"{name} exited with {proc.returncode}:\n{self.log(name)}"
                )
            return check()

        return wait_until(what, alive_then_check, timeout, explain=self.logs)

    def kill(self, name: str) -> float:
        """SIGKILL the whole peer (process, DHT node, libp2p daemon); the time it happened."""
        self.gone.add(name)
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        return time.time()

    def stop(self, *names: str) -> None:
        """SIGTERM the peers (they retire their records), then SIGKILL what is left of them."""
        self.gone.update(names)
        stop_processes([self.procs[name] for name in names])

    def finish(self, name: str, timeout: float = 150) -> Progress:
        """Wait for the peer to exit with 0; its last record."""
        try:
            code = self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} still running after {timeout}s:\n{self.log(name)}")
        assert code == 0, f"{name} exited with {code}:\n{self.log(name)}"
        return self.records(name)[-1]

    @contextlib.contextmanager
    def observer(self) -> Iterator[Membership]:
        """A DHT node of the test's own, joined to the swarm, to ask what the peers see: ``asyncio.run(membership.replicas(1))``."""
        dht = SwarmDHT(initial_peers=[self.join[1]], host_maddrs=[LOOPBACK])
        try:
            membership = Membership(dht)
            asyncio.run(membership.join(None, create=False, name=self.cfg.name))
            yield membership
        finally:
            dht.shutdown()


def swarmloco(
    *commands: Sequence[str], children: list[subprocess.Popen], timeout: float = 240, cwd: Path | None = None
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``swarmloco`` commands side by side (each loads torch and hivemind: seconds apiece); their results, in order.

    Each runs in its own process group and is registered in ``children``, so one that hangs (and the peers a
    ``swarmloco local`` started) is stopped with the test.
    """
    procs = []
    for args in commands:
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "peer", *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=cwd,
                start_new_session=True,
            )
        )
        children.append(procs[-1])
    results = []
    for args, proc in zip(commands, procs):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"swarmloco {' '.join(args)} still running after {timeout}s")
        results.append(subprocess.CompletedProcess(list(args), proc.returncode, out, err))
    return results


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, whatever its process group (Linux: read from /proc; elsewhere none)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):  # a process that exited while we looked
            parent = int(
                stat.read_text().rsplit(")", 1)[1].split()[1]
            )  # "pid (comm) state ppid …"; comm may hold spaces
            children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        found += (below := children.get(todo.pop(), []))
        todo += below
    return found


def reap(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Stop every process a test started and everything they started: the peers of a ``swarmloco local`` (each in its
    own process group), every peer's DHT process and libp2p daemon. SIGTERM first, then SIGKILL."""
    offspring = [
        pid for proc in procs if proc.poll() is None for pid in descendants(proc.pid)
    ]  # found before their parents go
    stop_processes(procs, grace_s=grace_s)
    for pid in offspring:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
