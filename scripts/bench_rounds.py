"""Outer-round time against group size: n replicas of one stage in real rounds on loopback, and a projection to 1,000.

Each replica is a ``swarmtest.loopback.LoopbackReplica``, as tests/test_outer_attacks.py runs them: its own hivemind
DHT node (``SwarmDHT``), libp2p daemon, ``Membership``, ``OuterService`` and ``ReplicaSync`` on stage 1 of the tiny
model, whose inner step is a small seeded random move of every weight (H = 3 inner steps every 0.1 s; matchmaking
window 1 s, RPC timeout 2 s, as the tests run). n replicas start, then run until each has done ``--rounds`` rounds
with all n together (or ``--timeout``).
Per round the script keeps what ``ReplicaSync`` logs (``round_s``, group, contributors, ``received_bytes``), the size of
each replica's own payload, and the DHT reads its ``Membership`` made (calls and records returned, by record kind).

Each (n, method) runs in a fresh process of this script. From the medians it fits received bytes ∝ (n − 1) and
round time = a + b·n, and projects a group round against NoLoCo-style pairs to n = 16, 100 and 1,000.

    python3 scripts/bench_rounds.py                                  # n = 2 4 8, diloco; table and projection
    python3 scripts/bench_rounds.py --sizes 2 4 8 --methods diloco sparseloco --json docs/data/rounds.json
    python3 scripts/bench_rounds.py --replot docs/data/rounds.json docs/data/rounds-8-window5s.json --plot docs/data/rounds.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from swarm.events import OuterRound, of_kind

PROJECT_TO = (16, 100, 1000)
PAIRWISE = ("noloco",)  # methods whose live round swaps payloads in pairs (``pair_round``)
LINK_MBIT = 100.0  # the projection's per-replica download link


# ---- one (n, method): real replicas in rounds -----------------------------------------------------------------------


def group_run(n: int, method: str, rounds: int, timeout_s: float, window_s: float | None = None) -> dict[str, Any]:
    """Start ``n`` replicas, wait for ``rounds`` rounds of all n together on every one; the rounds' records.

    ``window_s``: the matchmaking window (default: the tests' 1 s; the swarm's default is 5 s).
    """
    import dataclasses

    import torch

    from swarm.dht.membership import Membership
    from swarmtest.configs import LOOPBACK_ROUND_TIMEOUTS, outer_config
    from swarmtest.loopback import LoopbackReplica, stopping

    torch.set_num_threads(1)
    cfg = outer_config(method, timeouts=LOOPBACK_ROUND_TIMEOUTS)
    if window_s is not None:
        cfg = dataclasses.replace(cfg, timeouts=dataclasses.replace(cfg.timeouts, matchmaking_s=window_s))
    reads: dict[int, Counter] = {}  # id(membership) -> kind -> calls / records
    original_read = Membership._read

    async def counted_read(self: Membership, key: str, kind: type) -> dict:
        out = await original_read(self, key, kind)
        tally = reads.setdefault(id(self), Counter())
        tally[f"{kind.__name__}_calls"] += 1
        tally[f"{kind.__name__}_records"] += len(out)
        return out

    Membership._read = counted_read  # type: ignore[method-assign]  # counts every read (put back below)

    async def scenario() -> dict[str, Any]:
        t0 = time.perf_counter()
        first = await LoopbackReplica.start("r0", cfg, [], seed=1)
        rest = await asyncio.gather(
            *(LoopbackReplica.start(f"r{i}", cfg, first.peer.maddrs, seed=i + 1) for i in range(1, n))
        )
        replicas = [first, *rest]
        payload_bytes: list[int] = []
        for r in replicas:  # the size of each payload this replica offers
            make = r.sync.outer.make_payload

            def sized(local: Any, make: Any = make) -> bytes:
                data = make(local)
                payload_bytes.append(len(data))
                return data

            r.sync.outer.make_payload = sized
        started_s = time.perf_counter() - t0
        marks = [len(r.events) for r in replicas]
        before = {id(r.peer.membership): Counter(reads.get(id(r.peer.membership), {})) for r in replicas}

        def full(i: int) -> list[OuterRound]:
            return [e for e in of_kind(replicas[i].events[marks[i] :], OuterRound) if met_all(e, n, method)]

        async with stopping(*replicas):
            began = time.perf_counter()
            while time.perf_counter() - began < timeout_s and min(len(full(i)) for i in range(n)) < rounds:
                await asyncio.sleep(0.1)
            window = time.perf_counter() - began
            events = [e for i, r in enumerate(replicas) for e in of_kind(r.events[marks[i] :], OuterRound)]
            after = {id(r.peer.membership): Counter(reads.get(id(r.peer.membership), {})) for r in replicas}
        done = [e for e in events if e.outcome == "done"]
        together = [e for e in done if met_all(e, n, method)]
        dht = Counter()
        for key in after:
            dht.update(after[key] - before[key])
        per_replica_round = max(1, len(done))  # reads per replica per round done: all reads in the window / rounds
        return {
            "n": n,
            "method": method,
            "matchmaking_window_s": cfg.timeouts.matchmaking_s,
            "start_s": round(started_s, 2),
            "window_s": round(window, 2),
            "rounds_done_min": min(len(full(i)) for i in range(n)),
            "rounds_all_outcomes": dict(Counter(e.outcome for e in events)),
            "rounds_done": len(done),
            "rounds_together": len(together),
            "round_s": [round(e.round_s, 4) for e in together],
            "median_round_s": statistics.median(e.round_s for e in together) if together else None,
            "median_round_s_any_group": statistics.median(e.round_s for e in done) if done else None,
            "contributors_histogram": dict(sorted(Counter(e.contributors for e in done).items())),
            "median_group": statistics.median(e.group for e in done) if done else None,
            "median_contributors": statistics.median(e.contributors for e in done) if done else None,
            "median_received_bytes": statistics.median(e.received_bytes for e in together) if together else None,
            "payload_bytes": statistics.median(payload_bytes) if payload_bytes else None,
            "dht_reads_per_replica_round": {k: round(v / per_replica_round, 2) for k, v in sorted(dht.items())},
        }

    try:
        return asyncio.run(scenario())
    finally:
        Membership._read = original_read  # type: ignore[method-assign]  # put back


def met_all(event: OuterRound, n: int, method: str) -> bool:
    """A round done with all n: in the group round every member contributed; in NoLoCo's every member met and this one
    swapped with its partner (2 contributors, 3 in the odd one out's triple)."""
    if event.outcome != "done":
        return False
    if method in PAIRWISE:
        return event.group == n and event.contributors >= min(2, n)
    return event.contributors == n


# ---- the projection -------------------------------------------------------------------------------------------------


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b·x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def project(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method: fits of round time and DHT records read against n, and a group round vs pairs at 16, 100, 1,000."""
    out: dict[str, Any] = {}
    measured_pairs = [
        r["median_received_bytes"] for r in runs if r["method"] in PAIRWISE and r["median_received_bytes"]
    ]
    for method in sorted({r["method"] for r in runs} - set(PAIRWISE)):
        ok = [r for r in runs if r["method"] == method and r["median_round_s"] is not None]
        if len(ok) < 2:
            continue
        ns = [float(r["n"]) for r in ok]
        a, b = fit_line(ns, [r["median_round_s"] for r in ok])
        payload = statistics.median(r["payload_bytes"] for r in ok)
        per_peer = statistics.median(r["median_received_bytes"] / (r["n"] - 1) for r in ok)  # bytes ∝ n − 1
        decl = [r["dht_reads_per_replica_round"].get("RoundDeclaration_records", 0.0) for r in ok]
        da, db = fit_line(ns, decl)
        rows = []
        for n in PROJECT_TO:
            group_bytes = (n - 1) * per_peer
            # NoLoCo: one partner's payload of Δ and θ, each the size of a DiLoCo payload (measured when a run has one)
            pair_bytes = statistics.median(measured_pairs) if measured_pairs and method == "diloco" else 2 * payload
            rows.append(
                {
                    "n": n,
                    "group_round_s_fit": round(a + b * n, 2),
                    "group_received_bytes": round(group_bytes),
                    "group_download_s_at_link": round(group_bytes * 8 / (LINK_MBIT * 1e6), 3),
                    "group_messages_total": n * (n - 1) + (n - 1),  # payload fetches + commit fetches
                    "pair_received_bytes": round(pair_bytes),
                    "pair_download_s_at_link": round(pair_bytes * 8 / (LINK_MBIT * 1e6), 4),
                    "pair_messages_total": n,  # each replica fetches its partner's payload
                    "declaration_records_read_per_replica_round": round(da + db * n),
                }
            )
        out[method] = {
            "round_s_fit": {"a": round(a, 3), "b_per_replica": round(b, 4)},
            "received_bytes_per_other_member": per_peer,
            "payload_bytes": payload,
            "declaration_records_fit": {"a": round(da, 2), "b_per_replica": round(db, 2)},
            "link_mbit": LINK_MBIT,
            "rows": rows,
        }
    return out


PROJECTED_SIZES = (2, 4, 8, 16, 32, 100, 316, 1000)


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    """Two panels: the measured median round time against n (each run, by method and window) with the fitted line
    carried to 1,000; and what one replica receives per round in a group round ((n − 1) payloads) against a NoLoCo
    pair (one partner payload of Δ and θ: 2 payloads), for each method's measured payload."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (time_ax, bytes_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method in sorted({r["method"] for r in runs}):
        mine = [r for r in runs if r["method"] == method]
        for window in sorted({r["matchmaking_window_s"] for r in mine}):
            done = [r for r in mine if r["matchmaking_window_s"] == window and r["median_round_s"] is not None]
            if done:
                time_ax.plot(
                    [r["n"] for r in done],
                    [r["median_round_s"] for r in done],
                    "o",
                    label=f"{method}, {window:g} s window",
                )
        fitted = [r for r in mine if r["median_round_s"] is not None and r["matchmaking_window_s"] == 1.0]
        if len(fitted) >= 2:
            a, b = fit_line([float(r["n"]) for r in fitted], [r["median_round_s"] for r in fitted])
            time_ax.plot(
                PROJECTED_SIZES, [a + b * n for n in PROJECTED_SIZES], "--", label=f"{method} fit: {a:.2f} + {b:.3f}·n"
            )
        if method in PAIRWISE:  # measured: what one replica received per round of all n
            paired = [r for r in mine if r["median_received_bytes"]]
            bytes_ax.plot(
                [r["n"] for r in paired], [r["median_received_bytes"] for r in paired], "s", label=f"{method}, measured"
            )
            continue
        payload = statistics.median(r["payload_bytes"] for r in mine)
        bytes_ax.plot(PROJECTED_SIZES, [(n - 1) * payload for n in PROJECTED_SIZES], label=f"{method} group round")
        bytes_ax.plot(PROJECTED_SIZES, [2 * payload for _ in PROJECTED_SIZES], ":", label=f"{method} NoLoCo pair")
    time_ax.set(xscale="log", yscale="log", xlabel="replicas of the stage (n)", ylabel="median round (s)")
    time_ax.set_title("outer-round time (loopback, tiny stage; n = 8 at 1 s: no round of all 8)", fontsize=9)
    bytes_ax.set(
        xscale="log", yscale="log", xlabel="replicas of the stage (n)", ylabel="bytes received per replica-round"
    )
    bytes_ax.set_title("received per round: group all-gather against a pair", fontsize=9)
    for ax in (time_ax, bytes_ax):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def table(runs: list[dict[str, Any]], projection: dict[str, Any]) -> str:
    head = (
        "| n | method | rounds (min per replica, all n) | median round s | median group / contributors | "
        "received B per replica-round | payload B | DHT reads per replica-round (decl calls / records; replica records) |"
    )
    lines = [head, "|" + "---|" * 8]
    for r in runs:
        d = r["dht_reads_per_replica_round"]
        mr = r["median_round_s"]
        lines.append(
            f"| {r['n']} | {r['method']} | {r['rounds_done_min']} | {mr if mr is None else f'{mr:.2f}'} | "
            f"{r['median_group']} / {r['median_contributors']} | {r['median_received_bytes']} | {r['payload_bytes']} | "
            f"{d.get('RoundDeclaration_calls', 0)} / {d.get('RoundDeclaration_records', 0)}; "
            f"{d.get('StageStatus_records', 0)} |"
        )
    for method, p in projection.items():
        lines += [
            "",
            f"{method}: round s ≈ {p['round_s_fit']['a']} + {p['round_s_fit']['b_per_replica']}·n; "
            f"received ≈ (n−1) × {p['received_bytes_per_other_member']:.0f} B; declaration records read per "
            f"replica-round ≈ {p['declaration_records_fit']['a']} + {p['declaration_records_fit']['b_per_replica']}·n",
            "",
            f"| n | group round s (fit) | group: received B per replica | at {p['link_mbit']:.0f} Mbit/s | "
            "group fetches (all) | pairs: received B per replica | at link | pair fetches (all) | "
            "declaration records read per replica-round |",
            "|" + "---|" * 9,
        ]
        for row in p["rows"]:
            lines.append(
                f"| {row['n']} | {row['group_round_s_fit']} | {row['group_received_bytes']} | "
                f"{row['group_download_s_at_link']} s | {row['group_messages_total']} | {row['pair_received_bytes']} | "
                f"{row['pair_download_s_at_link']} s | {row['pair_messages_total']} | "
                f"{row['declaration_records_read_per_replica_round']} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--methods", nargs="+", default=["diloco"], choices=["diloco", "sparseloco", *PAIRWISE])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of all n together per replica")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds of rounds at most per (n, method)")
    parser.add_argument("--window-s", type=float, help="matchmaking window in seconds (default: the tests' 1 s)")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--plot", type=Path, metavar="PATH.png", help="plot round time and bytes against n (matplotlib)"
    )
    parser.add_argument("--replot", type=Path, nargs="+", metavar="JSON", help="plot earlier runs' JSON, run nothing")
    parser.add_argument("--one", nargs=2, metavar=("N", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(group_run(int(args.one[0]), args.one[1], args.rounds, args.timeout, args.window_s)))
        return
    if args.replot:
        if not args.plot:
            parser.error("--replot needs --plot PATH.png")
        plot([run for path in args.replot for run in json.loads(path.read_text())["runs"]], args.plot)
        print(f"wrote {args.plot}")
        return
    runs = []
    for method in args.methods:
        for n in args.sizes:
            cmd = [sys.executable, __file__, "--one", str(n), method, "--rounds", str(args.rounds)]
            cmd += ["--timeout", str(args.timeout)] + (["--window-s", str(args.window_s)] if args.window_s else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout + 300)
            if proc.returncode != 0:
                print(f"n={n} {method}: exit {proc.returncode}\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(f"n={n} {method}: {runs[-1]['rounds_done_min']} rounds, {runs[-1]['median_round_s']}", flush=True)
    projection = project(runs)
    print(table(runs, projection))
    load = os.getloadavg()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"load_average": [round(x, 2) for x in load], "runs": runs, "projection": projection}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
