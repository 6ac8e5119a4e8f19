"""A test swarm of real peer processes on loopback: spawn them, read their JSONL records, wait, kill.

    swarm = Swarm(tmp_path, cfg, child_processes)    # child_processes (conftest) kills whatever is left
    swarm.spawn("stage1-a", "--role", "stage", "--stage", "1")   # the first peer creates the swarm
    swarm.spawn("trainer-0", "--role", "trainer", "--steps", "30", "--data", DATA)
    swarm.wait("10 steps", lambda: any(r["step"] >= 10 for r in swarm.progress("trainer-0")), 120)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from peer.launch import spawn_peer, wait_for_address
from swarm.config import SwarmConfig, save_config


class Swarm:
    """Peers of one test swarm; the first one spawned creates it from ``cfg``, the others join through it."""

    def __init__(self, out: Path, cfg: SwarmConfig, children: list[subprocess.Popen]) -> None:
        self.out, self.cfg, self.children = out, cfg, children
        self.procs: dict[str, subprocess.Popen] = {}
        self.ids: dict[str, str] = {}  # name → peer id, for peers waited on with ``ready``
        self.started: dict[str, float] = {}
        self.join: list[str] = []  # --initial-peers of the first peer
        self.killed: set[str] = set()
        save_config(cfg, out / "swarm.toml")

    def spawn(self, name: str, *args: str) -> None:
        common = ["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--out", str(self.out), "--threads", "1"]
        self.started[name] = time.time()
        self.procs[name] = spawn_peer(name, [*args, *(self.join or ["--config", str(self.out / "swarm.toml")]), *common], self.out)
        self.children.append(self.procs[name])
        if not self.join:  # everyone else joins through the first peer
            self.ready(name)

    def ready(self, name: str) -> str:
        """Wait until the peer prints its address; that address."""
        maddr = wait_for_address(self.procs[name], self.out / f"{name}.log", 120)
        self.ids[name] = maddr.rsplit("/p2p/", 1)[1]
        self.join = self.join or ["--initial-peers", maddr]
        return maddr

    def records(self, name: str, event: str | None = None) -> list[dict]:
        """The peer's JSONL records of ``event`` (None: progress records, which have no event)."""
        path = self.out / f"{name}.jsonl"
        lines = path.read_text().split("\n")[:-1] if path.exists() else []  # the last line may be half written
        return [r for r in map(json.loads, lines) if r.get("event") == event]

    def progress(self, name: str) -> list[dict]:
        return [r for r in self.records(name) if r.get("role") == "trainer"]

    def rounds(self, name: str) -> list[dict]:
        return [r for r in self.records(name, "outer_round") if r["outcome"] == "done"]

    def served(self, name: str) -> set[str]:
        return {r["sha256"] for r in self.records(name, "state_served")}

    def log(self, name: str, chars: int = 3000) -> str:
        return (self.out / f"{name}.log").read_text()[-chars:]

    def wait(self, what: str, check: Callable[[], object], timeout: float) -> object:
        """Poll ``check`` until it returns something true; fail with every log if it times out or a live peer dies."""
        deadline = time.monotonic() + timeout
        while not (result := check()):
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {n}\n{self.log(n, 2000)}" for n in self.procs)
                pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}\n{logs}")
            for name, proc in self.procs.items():
                assert proc.poll() in (None, 0) or name in self.killed, f"{name} exited with {proc.returncode}:\n{self.log(name)}"
            time.sleep(0.1)
        return result

    def kill(self, name: str) -> float:
        """SIGKILL the whole peer (process, DHT node, libp2p daemon); the time it happened."""
        self.killed.add(name)
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        return time.time()

    def finish(self, name: str, timeout: float = 150) -> dict:
        """Wait for the peer to exit with 0; its last record."""
        try:
            code = self.procs[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} still running after {timeout}s:\n{self.log(name)}")
        assert code == 0, f"{name} exited with {code}:\n{self.log(name)}"
        return self.records(name)[-1]
