"""Churn on a local swarm: SIGKILL a random peer every few seconds, start a fresh ``--role auto`` peer in its place,
and check at the end that every trainer's microbatches are accounted for and no process of the run is left.

Each peer is a real ``swarmloco run`` process (tiny model, 2 middle stages, one thread) on loopback, started as
``swarmloco local`` starts them (``peer.launch.spawn_peer``). The kill hits the peer's main process only, as the
OOM killer would: its DHT process and libp2p daemon must then go by themselves (issue 20 item 7). Every couple of
seconds the script samples each peer's RSS and CPU (process and descendants, read from /proc). DHT stores per second
come from the peers' own counts (``dht_stores`` in the metrics of their JSONL records: every record a peer stored).

    python3 scripts/bench_churn.py                                   # 16 peers, a kill every 20 s for 300 s
    python3 scripts/bench_churn.py --peers 8 --duration 120 --json docs/data/churn.json
    python3 scripts/bench_churn.py --replot docs/data/churn-2026-11-24.json --plot docs/data/churn.png   # per-peer RSS, CPU
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from peer.launch import spawn_peer, stop_processes, wait_for_address
from swarm.config import TrainerOptions
from swarm.config_toml import save_config
from swarm.events import Event, Metrics, Progress, of_kind, read_events
from swarm.node.config import PeerConfig
from swarmtest.configs import DATA, tiny_config

STEPS = 1_000_000  # trainers train until stopped
SAMPLE_EVERY_S = 2.0
ORPHAN_GRACE_S = 10.0  # how long a killed peer's DHT process and daemon may take to notice
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def proc_stat(pid: int) -> tuple[int, int, float] | None:
    """(ppid, rss bytes, cpu seconds) of a live process, None if gone; comm may hold spaces, hence the rsplit."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[21]) * PAGE, (int(fields[11]) + int(fields[12])) / CLK_TCK


def children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        if (stat := proc_stat(int(entry.name))) is not None:
            children.setdefault(stat[0], []).append(int(entry.name))
    return children


def tree(pid: int, children: dict[int, list[int]]) -> list[int]:
    found, todo = [pid], [pid]
    while todo:
        found += (below := children.get(todo.pop(), []))
        todo += below
    return found


def alive(pid: int) -> bool:
    return proc_stat(pid) is not None


def last_progress(out: Path, name: str) -> Progress | None:
    progress = [r for r in of_kind(records(out, name), Progress) if r.role == "trainer"]
    return progress[-1] if progress else None


def records(out: Path, name: str) -> list[Event]:
    return read_events(out / f"{name}.jsonl")


def last_stage_record(out: Path, name: str) -> Progress | None:
    stage = [r for r in of_kind(records(out, name), Progress) if r.role == "stage"]
    return stage[-1] if stage else None


def dht_stores(out: Path, name: str) -> list[tuple[float, int]]:
    """(time, DHT stores since the peer started) from each of its records that carries its metrics."""
    return [
        (r.time, r.metrics["dht_stores"]) for r in of_kind(records(out, name), Metrics) if "dht_stores" in r.metrics
    ]


def dht_store_rates(out: Path, spawned: dict[str, float], window: tuple[float, float]) -> dict[str, Any]:
    """DHT stores per second: each peer's over its logged span (first to last record carrying its count), and the
    swarm's over ``window`` (the churn): every peer's count, 0 when it was spawned and linear between its records
    (flat after its last: a killed peer's last few stores are lost), summed over the peers."""
    per_peer, stored = {}, 0.0
    for name, spawned_at in spawned.items():
        if not (counts := dht_stores(out, name)):
            continue
        times, stores = zip(*[(spawned_at, 0), *counts], strict=True)
        stored += float(np.interp(window[1], times, stores) - np.interp(window[0], times, stores))
        (t0, n0), (t1, n1) = counts[0], counts[-1]
        if t1 > t0:
            per_peer[name] = (n1 - n0) / (t1 - t0)
    rates = sorted(per_peer.values())
    return {
        "per_peer_per_s": per_peer,
        "per_peer_median_per_s": rates[len(rates) // 2] if rates else None,
        "swarm_stores": round(stored),
        "swarm_window_s": window[1] - window[0],
        "swarm_per_s": stored / (window[1] - window[0]) if window[1] > window[0] else None,
    }


def role_of(out: Path, name: str) -> str:
    """The role a peer took (``auto`` peers decide after joining): that of its last record, "joining" before any."""
    roles = [r.role for r in of_kind(records(out, name), Progress)]
    return roles[-1] if roles else "joining"


class Churn:
    def __init__(self, args: argparse.Namespace, out: Path) -> None:
        self.args, self.out = args, out
        self.procs: dict[str, subprocess.Popen] = {}
        self.spawned: dict[str, float] = {}  # name → when it was started (its DHT store count is 0 then)
        self.churn: tuple[float, float] = (0.0, 0.0)  # from the warm-up's end to the last kill's period's end
        self.killed: list[dict[str, Any]] = []
        self.seen_pids: dict[int, str] = {}  # every pid ever in a peer's tree: none may outlive the run
        self.samples: dict[str, list[tuple[float, float, float]]] = {}  # name → (time, rss, cpu s) of the tree
        self.join: list[str] = []  # the first peer's address, once it printed it
        self.rng = random.Random(args.seed)

    def spawn(self, name: str, role: PeerConfig) -> None:
        common = {"host_maddrs": ["/ip4/127.0.0.1/tcp/0"], "out": self.out, "threads": 1, "data": [DATA]}
        peer = dataclasses.replace(role, **common, steps=STEPS, initial_peers=self.join)
        config = [] if self.join else ["--config", str(self.out / "swarm.toml")]
        self.spawned[name] = time.time()
        self.procs[name] = spawn_peer(name, [*peer.to_argv(), *config], self.out)

    def start(self) -> None:
        args = self.args
        trainers = max(1, args.peers // 4)
        servers = args.peers - trainers
        self.spawn("stage1-0", PeerConfig(role="stage", stage=1))
        self.join = [wait_for_address(self.procs["stage1-0"], self.out / "stage1-0.log", 180)]
        for k in range(1, servers):
            self.spawn(f"stage{k % 2 + 1}-{k // 2}", PeerConfig(role="stage", stage=k % 2 + 1))
        for i in range(trainers):
            self.spawn(f"trainer-{i}", PeerConfig(role="trainer", seed=i))

    def sample(self) -> None:
        children, now = children_map(), time.time()
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                continue
            rss = cpu = 0.0
            for pid in tree(proc.pid, children):
                self.seen_pids[pid] = name
                if (stat := proc_stat(pid)) is not None:
                    rss, cpu = rss + stat[1], cpu + stat[2]
            self.samples.setdefault(name, []).append((now, rss, cpu))

    def kill_one(self, number: int) -> None:
        """SIGKILL one live non-bootstrap peer's main process (not its group); a fresh ``--role auto`` peer replaces it."""
        live = [n for n, p in self.procs.items() if n != "stage1-0" and p.poll() is None]
        victim = self.rng.choice(live)
        proc = self.procs[victim]
        below = [pid for pid in tree(proc.pid, children_map()) if pid != proc.pid]
        role = role_of(self.out, victim)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        self.killed.append({"peer": victim, "role": role, "time": time.time(), "descendants": below})
        self.spawn(f"auto-{number}", PeerConfig(role="auto"))
        print(f"[{time.strftime('%X')}] killed {victim} ({role}); auto-{number} joins", flush=True)

    def orphans_of_kills(self) -> list[dict[str, Any]]:
        """Descendants of killed peers still alive ``ORPHAN_GRACE_S`` after the kill (checked once the grace passed)."""
        left = []
        for kill in self.killed:
            wait = kill["time"] + ORPHAN_GRACE_S - time.time()
            if wait > 0:
                time.sleep(wait)
            kill["orphans"] = [pid for pid in kill["descendants"] if alive(pid)]
            left += [{"peer": kill["peer"], "pid": pid} for pid in kill["orphans"]]
        return left

    def run(self) -> dict[str, Any]:
        args = self.args
        loads, started = [], time.time()
        self.start()
        next_kill, next_sample, kills = started + args.warmup + args.kill_every, started, 0
        end = started + args.warmup + args.duration
        self.churn = (started + args.warmup, end)
        while (now := time.time()) < end:
            if now >= next_sample:
                self.sample()
                loads.append(os.getloadavg()[0])
                next_sample = now + SAMPLE_EVERY_S
            if now >= next_kill:
                kills += 1
                self.kill_one(kills)
                next_kill = now + args.kill_every
            time.sleep(0.2)
        self.sample()
        orphans_of_kills = self.orphans_of_kills()
        stop_processes(list(self.procs.values()))
        time.sleep(ORPHAN_GRACE_S)
        left = [{"peer": name, "pid": pid} for pid, name in self.seen_pids.items() if alive(pid)]
        return self.report(orphans_of_kills, left, loads, time.time() - started)

    def report(self, orphans_of_kills: list, left: list, loads: list[float], wall_s: float) -> dict[str, Any]:
        in_flight_cap = TrainerOptions().in_flight
        trainers = []
        for name in self.procs:
            if (r := last_progress(self.out, name)) is None:
                continue
            in_flight = r["started"] - r["completed"] - r["failed"] - r["cancelled"]
            killed = any(k["peer"] == name for k in self.killed)
            trainers.append(
                {
                    "peer": name,
                    "killed": killed,
                    "step": r["step"],
                    **{
                        k: r[k] for k in ("started", "completed", "failed", "cancelled", "hop_failures", "skipped_hops")
                    },
                    "in_flight": in_flight,
                    "accounted": 0 <= in_flight <= in_flight_cap,
                    "train_loss": r.get("train_loss"),
                }
            )
        stores = dht_store_rates(self.out, self.spawned, self.churn)
        peers = []
        for name, samples in self.samples.items():
            if len(samples) < 2:
                continue
            span = samples[-1][0] - samples[0][0]
            peers.append(
                {
                    "peer": name,
                    "role": role_of(self.out, name),
                    "peak_rss_mb": max(s[1] for s in samples) / 1e6,
                    "mean_rss_mb": sum(s[1] for s in samples) / len(samples) / 1e6,
                    "cpu_percent": 100 * (samples[-1][2] - samples[0][2]) / span if span > 0 else 0.0,
                    "sampled_s": span,
                    "dht_stores_per_s": stores["per_peer_per_s"].get(name),
                }
            )
        servers = {name: r for name in self.procs if (r := last_stage_record(self.out, name))}
        return {
            "outer_strikes": sum(r.get("outer_strikes", 0) for r in servers.values()),
            "outer_bans": sum(r.get("outer_bans", 0) for r in servers.values()),
            "outer_done": {name: r.get("outer_done", 0) for name, r in servers.items()},
            "peers": self.args.peers,
            "duration_s": self.args.duration,
            "kill_every_s": self.args.kill_every,
            "wall_s": wall_s,
            "kills": self.killed,
            "trainers": trainers,
            "per_peer": peers,
            "dht_stores": {k: v for k, v in stores.items() if k != "per_peer_per_s"},
            "orphans_after_kill": orphans_of_kills,
            "left_after_stop": left,
            "load_avg": {"mean": sum(loads) / max(len(loads), 1), "max": max(loads, default=0.0)},
            "cpus": os.cpu_count(),
            "invariants": {
                "microbatches_accounted": all(t["accounted"] for t in trainers),
                "no_orphans": not orphans_of_kills and not left,
            },
        }


def print_table(result: dict[str, Any]) -> None:
    print(
        f"\n{'trainer':<10} {'killed':>6} {'step':>5} {'started':>7} {'done':>6} {'failed':>6} {'cancel':>6} {'inflt':>5}"
    )
    for t in result["trainers"]:
        print(
            f"{t['peer']:<10} {'yes' if t['killed'] else 'no':>6} {t['step']:>5} {t['started']:>7} {t['completed']:>6} "
            f"{t['failed']:>6} {t['cancelled']:>6} {t['in_flight']:>5}"
        )
    print(f"\n{'peer':<10} {'role':<8} {'peak RSS MB':>11} {'mean RSS MB':>11} {'CPU %':>6} {'DHT stores/s':>12}")
    for p in result["per_peer"]:
        rate = "-" if p["dht_stores_per_s"] is None else f"{p['dht_stores_per_s']:.2f}"
        print(
            f"{p['peer']:<10} {p['role']:<8} {p['peak_rss_mb']:>11.0f} {p['mean_rss_mb']:>11.0f} {p['cpu_percent']:>6.1f}"
            f" {rate:>12}"
        )
    stores = result["dht_stores"]
    if stores["swarm_per_s"] is not None:
        print(
            f"DHT stores: {stores['swarm_per_s']:.1f}/s for the swarm ({stores['swarm_stores']} in the "
            f"{stores['swarm_window_s']:.0f} s of churn), median {stores['per_peer_median_per_s'] or 0:.2f}/s per peer"
        )
    print(
        f"\nkills {len(result['kills'])}, orphans after kill {len(result['orphans_after_kill'])}, processes left after "
        f"stop {len(result['left_after_stop'])}; load average mean {result['load_avg']['mean']:.1f} max "
        f"{result['load_avg']['max']:.1f} on {result['cpus']} CPUs; servers' outer strikes {result['outer_strikes']}, "
        f"bans {result['outer_bans']}; invariants {result['invariants']}"
    )


def plot(result: dict, path: Path) -> None:
    """Per peer, by role: peak and mean RSS (process, DHT process and p2pd) and CPU share, with the swarm's DHT
    stores per second in the title."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    peers = sorted(result["per_peer"], key=lambda p: (p["role"], p["peer"]))
    names, xs = [p["peer"] for p in peers], range(len(peers))
    colour = {"stage": "tab:blue", "trainer": "tab:orange", "full": "tab:green"}
    fig, (rss_ax, cpu_ax) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    rss_ax.bar(xs, [p["peak_rss_mb"] for p in peers], color=[colour.get(p["role"], "grey") for p in peers], alpha=0.4)
    rss_ax.bar(xs, [p["mean_rss_mb"] for p in peers], color=[colour.get(p["role"], "grey") for p in peers])
    rss_ax.set(ylabel="RSS MB (mean; peak light)")
    cpu_ax.bar(xs, [p["cpu_percent"] for p in peers], color=[colour.get(p["role"], "grey") for p in peers])
    cpu_ax.set(ylabel="CPU % of one core")
    cpu_ax.set_xticks(list(xs), names, rotation=70, fontsize=7)
    stores = result["dht_stores"]
    rss_ax.set_title(
        f"{result['peers']} peers, a kill every {result['kill_every_s']:g} s for {result['duration_s']:g} s on "
        f"{result['cpus']} cores: DHT stores {stores['swarm_per_s']:.1f}/s for the swarm, "
        f"{stores['per_peer_median_per_s']:.2f}/s per peer (blue stage servers, orange trainers, grey killed while joining)",
        fontsize=8,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=16)
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of churn")
    parser.add_argument("--kill-every", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds after the start before the first kill")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="peer logs and metrics (default: a temporary directory)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, metavar="PATH.png", help="plot per-peer RSS and CPU (matplotlib)")
    parser.add_argument("--replot", type=Path, metavar="JSON", help="plot an earlier run's JSON, run nothing")
    args = parser.parse_args()
    if args.replot:
        if not args.plot:
            parser.error("--replot needs --plot PATH.png")
        plot(json.loads(args.replot.read_text()), args.plot)
        print(f"wrote {args.plot}")
        return
    out = (args.out or Path(tempfile.mkdtemp(prefix="churn-"))).resolve()
    out.mkdir(parents=True, exist_ok=True)
    save_config(tiny_config(stages=2, steps=STEPS), out / "swarm.toml")
    churn = Churn(args, out)
    try:
        result = churn.run()
    finally:
        with contextlib.suppress(Exception):
            stop_processes(list(churn.procs.values()), grace_s=5)
    result["out"] = str(out)
    print_table(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
