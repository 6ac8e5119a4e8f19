"""How long a stage server takes from launch to serving, and what the time goes to (issue 33, deliverable 5).

Each start is a fresh process that runs ``swarmloco run --role stage --stage 1`` as the CLI does (``run_peer``)
and stops itself once it prints its ready line. Its phases are timed by wrapping the functions of the start
path (``PHASES``), each timed without the phases it calls (the rows add up to the total); ``other`` is the rest.

- ``seeded``: the stage's first server (it creates the swarm): nothing to download, the seeded weights.
- ``joiner`` (``--joiner``): a second server of the same stage joins the first and downloads its state
  (the first serves it: ``state export``), then serves; its own process, started once the first serves.

Sizes (``SIZES``): ``125m`` is stage 1 of 2 of the 125m preset (6 blocks, 42.5M parameters); ``0.5b`` stage 1
of 2 of the 1b preset (10 blocks, 504M parameters). A 0.5B stage server needs ≈ 23 GiB once it trains (AdamW,
outer state): more than a small machine has free, so its memory check is skipped here (``--ignore-fit``, the
default for 0.5b): starting it allocates only the weights and the outer step's global copy.

    python scripts/bench_stage_start.py                                  # 125m and 0.5b, seeded (~1 min on 2 cores)
    python scripts/bench_stage_start.py --sizes 125m --joiner --json stage-start.json
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

T0 = time.perf_counter()  # before the heavy imports: what "imports" measures

SIZES: dict[str, dict[str, Any]] = {
    "125m": {"model.preset": "125m", "stages.num_stages": 2},
    "0.5b": {"model.preset": "1b", "stages.num_stages": 2},
}
# (label, module, attribute): the start path's functions, timed where they are looked up (a module's own name); the
# script runs on the code before issue 33's changes too (PYTHONPATH=<an export of it>), for the before/after table
PHASES: list[tuple[str, str, str]] = [
    ("join: DHT start", "swarm.node", "start_dht"),  # before the node package (issue 35)
    ("join: DHT start", "swarm.node.node", "start_dht"),
    ("join: swarm config", "swarm.dht.membership", "Membership.join"),
    ("state lookup (records, download)", "swarm.roles", "StageRole._initial_state"),
    ("state lookup (records, download)", "swarm.node.roles.stage_server", "StageRole._initial_state"),
    ("download: stage template", "swarm.outer.service", "stage_template"),  # before: the seeded stage, drawn
    ("download: stage template", "swarm.outer.download", "stage_shapes"),  # now: meta shapes and the seeded norms
    ("download: stage template", "swarm.outer.download", "seeded_norms"),
    ("stage init (build_stage)", "swarm.pipeline.server", "build_stage"),
    ("inner optimizer (AdamW)", "swarm.pipeline.server", "InnerStep"),
    ("outer state (global copy)", "swarm.outer.replica", "build_outer_optimizer"),
    ("weights hash", "swarm.outer.replica", "weights_hash"),
    ("weights hash", "swarm.outer.state", "weights_hash"),
    ("weights hash", "swarm.served_stage", "weights_hash"),
    ("weights hash", "swarm.node.roles.served", "weights_hash"),
    ("adopt downloaded state", "swarm.outer.replica", "ReplicaSync.adopt"),
    ("server and sync (rest)", "swarm.served_stage", "ServedStage.__init__"),
    ("serve: handlers, records", "swarm.served_stage", "ServedStage.start"),
    ("server and sync (rest)", "swarm.node.roles.served", "ServedStage.__init__"),
    ("serve: handlers, records", "swarm.node.roles.served", "ServedStage.start"),
]
READY = "of swarm ready"


class Phases:
    """Exclusive wall time per label: a phase's time excludes the phases it calls. A phase run on another thread (a
    download's template) is taken out of the main thread's phase that awaits it."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.stacks: defaultdict[int, list[list[Any]]] = defaultdict(list)  # per thread: [label, started, nested]
        self.main = threading.main_thread().ident
        self.lock = threading.Lock()

    def enter(self, label: str) -> None:
        with self.lock:
            self.stacks[threading.get_ident()].append([label, time.perf_counter(), 0.0])

    def leave(self, label: str) -> None:
        with self.lock:
            stack = self.stacks[threading.get_ident()]
            _, started, nested = stack.pop()
            took = time.perf_counter() - started
            self.seconds[label] += took - nested
            if stack:
                stack[-1][2] += took
            elif threading.get_ident() != self.main and self.stacks[self.main]:
                self.stacks[self.main][-1][2] += took

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def timed_async(*args: Any, **kwargs: Any) -> Any:
                self.enter(label)
                try:
                    return await fn(*args, **kwargs)
                finally:
                    self.leave(label)

            return timed_async

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.enter(label)
            try:
                return fn(*args, **kwargs)
            finally:
                self.leave(label)

        return timed

    def install(self) -> None:
        import importlib

        for label, module_name, path in PHASES:
            try:
                owner: Any = importlib.import_module(module_name)
            except ModuleNotFoundError:  # a module of another version of the start path
                continue
            *outer, attr = path.split(".")
            for name in outer:
                owner = getattr(owner, name)
            if hasattr(owner, attr):  # a function of another version of the start path may be missing
                setattr(owner, attr, self.wrap(label, getattr(owner, attr)))


def one_start(size: str, *, join: list[str], threads: int, ignore_fit: bool, profile: Path | None) -> dict[str, Any]:
    """This process: one stage server of ``size`` started as ``swarmloco run`` starts it, stopped once ready."""
    import torch

    from peer import launch
    from swarm import node as node_module
    from swarm.config import SwarmConfig, derive_config
    from swarm.config_toml import save_config
    from swarm.model.sizing import StageFootprint
    from swarm.node.config import PeerConfig

    imported = time.perf_counter()
    phases = Phases()
    phases.install()
    cfg = derive_config(SwarmConfig(), SIZES[size])
    if ignore_fit:
        node_module.check_fits = lambda footprint, **kwargs: None  # only the start is measured (module docstring)
    marks: dict[str, float] = {}
    original_start = node_module.Node.start

    profiler = None
    if profile is not None:  # pip install pyinstrument
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.005, async_mode="disabled")

    async def start(self: Any) -> None:
        marks["join_begin"] = time.perf_counter()
        await original_start(self)
        marks["joined"] = time.perf_counter()
        if profiler is not None:
            profiler.start()

    node_module.Node.start = start
    lines: list[str] = []

    def echo(line: str) -> None:
        lines.append(line)
        if READY in line and "ready" not in marks:
            marks["ready"] = time.perf_counter()
            if profiler is not None:
                profiler.stop()
                mode = "joiner" if join else "seeded"
                (profile / f"{size}-{mode}.txt").write_text(profiler.output_text(unicode=True, show_all=False))
            threading.Thread(target=stop_when, args=(join,), daemon=True).start()
        if line.startswith(launch.READY_PREFIX) and not join:
            print("MADDRS " + line[len(launch.READY_PREFIX) :], flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "swarm.toml"
        save_config(cfg, path)
        peer = PeerConfig(
            role="stage",
            stage=1,
            initial_peers=join,
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            threads=threads,
            name=f"bench-{size}-{'joiner' if join else 'seeded'}",
        )
        launch.run_peer(peer, config=None if join else path, echo=echo)
    launched = float(os.environ.get("BENCH_LAUNCHED_AT", "0")) or None
    ready_at = time.time() - (time.perf_counter() - marks["ready"])
    total = marks["ready"] - marks["joined"]
    rows = {label: round(s, 3) for label, s in phases.seconds.items() if not label.startswith("join:")}
    rows["other"] = round(total - sum(rows.values()), 3)
    return {
        "size": size,
        "mode": "joiner" if join else "seeded",
        "parameters": StageFootprint.of(cfg, 1).parameters,
        "torch_threads": torch.get_num_threads(),
        "imports_s": round(imported - T0, 3),
        "join_s": round(marks["joined"] - marks["join_begin"], 3),
        "join_phases_s": {k: round(v, 3) for k, v in phases.seconds.items() if k.startswith("join:")},
        "phases_s": rows,
        "join_to_ready_s": round(total, 3),
        "launch_to_ready_s": round(ready_at - launched, 3) if launched else None,
        "peak_rss_mb": round(vm_kb("VmHWM") / 1024, 1),
    }


def stop_when(join: list[str]) -> None:
    """A joiner stops at once; the first server once its parent closes stdin (the joiner has come and gone)."""
    if not join:
        sys.stdin.read()
    os.kill(os.getpid(), signal.SIGTERM)  # what Ctrl+C does: run_peer retires the records and returns


def vm_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def child(args: list[str], *, hold: bool = False) -> subprocess.Popen[str]:
    env = {**os.environ, "BENCH_LAUNCHED_AT": repr(time.time())}
    return subprocess.Popen(
        [sys.executable, __file__, *args],
        stdin=subprocess.PIPE if hold else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def result_of(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=timeout)
    return parse_result(proc, out)


def parse_result(proc: subprocess.Popen[str], out: str) -> dict[str, Any]:
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"no result (exit {proc.returncode}):\n{out[-2000:]}")


def measure(
    size: str, *, joiner: bool, threads: int, ignore_fit: bool, timeout: float, profile: Path | None
) -> list[dict[str, Any]]:
    flags = ["--threads", str(threads)] + (["--ignore-fit"] if ignore_fit else [])
    flags += ["--profile", str(profile)] if profile else []
    if not joiner:
        return [result_of(child(["--one", size, *flags]), timeout)]
    first = child(["--one", size, *flags], hold=True)
    assert first.stdout is not None
    maddrs: list[str] = []
    while line := first.stdout.readline():
        if line.startswith("MADDRS "):
            maddrs = line.split()[1:]
            break
    if not maddrs:
        first.kill()
        raise RuntimeError("the first server never got ready")
    try:
        second = result_of(child(["--one", size, *flags, "--join", *maddrs]), timeout)
    finally:
        assert first.stdin is not None
        first.stdin.close()  # the first server stops
    rest = first.stdout.read()
    first.wait(timeout)
    return [parse_result(first, rest), second]


def table(results: list[dict[str, Any]]) -> str:
    heads = [f"{r['size']} {r['mode']}" for r in results]
    labels = ["imports", "join (DHT, config)"]
    labels += list(dict.fromkeys(label for r in results for label in r["phases_s"] if label != "other"))
    labels += ["other", "join → ready", "launch → ready", "peak RSS (MB)"]

    def value(r: dict[str, Any], label: str) -> str:
        v = {
            "imports": r["imports_s"],
            "join (DHT, config)": r["join_s"],
            "join → ready": r["join_to_ready_s"],
            "launch → ready": r["launch_to_ready_s"],
            "peak RSS (MB)": r["peak_rss_mb"],
        }.get(label, r["phases_s"].get(label))
        return "-" if v is None else f"{v:.0f}" if label == "peak RSS (MB)" else f"{v:.2f}"

    width, cols = max(map(len, labels)) + 1, [max(len(h), 8) for h in heads]
    lines = [f"| {'phase (s)':<{width}}| " + " | ".join(f"{h:>{c}}" for h, c in zip(heads, cols)) + " |"]
    lines.append("|" + "-" * (width + 1) + "|" + "|".join("-" * (c + 2) for c in cols) + "|")
    for label in labels:
        row = " | ".join(f"{value(r, label):>{c}}" for r, c in zip(results, cols))
        lines.append(f"| {label:<{width}}| {row} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="125m,0.5b", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--joiner", action="store_true", help="also start a second server that downloads the state")
    parser.add_argument("--threads", type=int, default=0, help="torch threads per server (0: torch's default)")
    parser.add_argument("--ignore-fit", action="store_true", help="skip the memory check (always for 0.5b)")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--profile", type=Path, help="write each start's profile from join to ready here (pyinstrument)"
    )
    parser.add_argument("--one", choices=list(SIZES), help=argparse.SUPPRESS)  # a child: one start
    parser.add_argument("--join", nargs="+", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        result = one_start(
            args.one, join=args.join, threads=args.threads, ignore_fit=args.ignore_fit, profile=args.profile
        )
        print("RESULT " + json.dumps(result), flush=True)
        return
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    results = []
    for size in args.sizes.split(","):
        results += measure(
            size,
            joiner=args.joiner,
            threads=args.threads,
            ignore_fit=args.ignore_fit or size == "0.5b",
            timeout=args.timeout,
            profile=args.profile,
        )
        print(table(results[-2 if args.joiner else -1 :]), flush=True)
    print()
    print(table(results))
    if args.json:
        args.json.write_text(json.dumps({"cpus": os.cpu_count(), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
