"""The GPU check: train-local at 125m and 1b and local swarms at 125m, on one CUDA GPU, in one table (issues 33, 34).

Four steps, each a ``python -m peer`` subprocess with its own timeout (a step that fails or times out gets a row
saying so, and the next one runs), its output in ``OUT/<step>.log`` and its metrics under ``OUT/<step>/``:

- ``125m``: ``train-local`` of the 125m preset in bf16, microbatch 8 x 1024, inner batch 16, 50 steps (timeout 80 s);
- ``1b``: ``train-local`` of the 1b preset in bf16, microbatch 8 x 1024 (4 when the whole model's estimate does not
  fit the GPU's free memory), 20 steps (timeout 110 s);
- ``swarm``: ``local`` at 125m in bf16, microbatch 8 x 1024: 2 trainers (K = 2 replicas of stage 0) and 2 middle
  stages of 2 servers each, 30 steps with an outer round every 5 (no warm start), every peer on the GPU
  (timeout 150 s);
- ``swarm1x2``: ``local`` at the ``125m`` step's shapes: 1 trainer and one server for each of 2 stages sharing the
  GPU, no outer step, 30 steps (timeout 110 s).

The table has per row: tokens/s (after the first logged window, with compiling and warm-up, validation time left out;
a swarm: its trainers' together), MFU ((6N + 12·layers·d·T) FLOPs per token × tokens/s ÷ the GPU's bf16 dense peak,
N the parameters but the embedding table's; n/a on a CPU, which has no stated peak here), ratio (a swarm's tokens/s ÷
the ``125m`` train-local's at the same shapes, in the same run), peak GPU memory (``peak_gpu_mb`` of the process's records; the
swarm: its largest peer), train loss of the first and last logged windows, outer rounds done (the swarm: the fewest
of any stage), failed hops, wall time and status (``ok``, or what went wrong). The JSON (``--json``, default
``OUT/gpu_check.json``) holds the rows, the table and the host. The timeouts add up to 450 s, and ``--budget`` (480 s)
cuts a step's timeout to what is left, so the whole check ends within 8 minutes whatever hangs. ``--compile`` is every
process's (auto: on for CUDA; a row's ``compile_s`` is train-local's compile time). ``--cpu`` runs the same four steps
at toy sizes on the CPU (tests/test_gpu_check.py).

On the GPU host, after the wheel install of ../shared/gpu/README.md (``PYTHONPATH=/tmp/site:$PWD``):

    python3 scripts/gpu_check.py                        # all four, table + runs/gpu-check/gpu_check.json
    python3 scripts/gpu_check.py --only swarm --set train.microbatch_size=2    # one step, another microbatch
    python3 scripts/gpu_check.py --cpu --out /tmp/gc    # toy sizes on the CPU (2-4 min on 2 shared cores)
    python3 scripts/gpu_check.py --only 125m swarm1x2 --compile off   # the pair, eager
    python3 scripts/gpu_check.py --dry-run              # the plan: configs, commands, memory estimates; runs nothing
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from peer.launch import LocalSwarm
from swarm.cli_fields import add_field_arguments
from swarm.config import ConfigValue, SwarmConfig, parse_overrides
from swarm.config_toml import load_config
from swarm.events import Progress, of_kind
from swarm.model.sizing import StageFootprint, model_parameters
from swarm.node.config import PeerConfig
from swarmtest.bench import read_peers, swarm_summary

REPO = Path(__file__).resolve().parents[1]

# bf16 dense tensor-core peaks, TFLOP/s, by a substring of the device's name (first match)
PEAK_TFLOPS = (("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0))
PREFLIGHT_TIMEOUT_S = 60
BUDGET_S = 480.0  # the whole check: 8 minutes
STOP_GRACE_S = 25.0  # after SIGINT: a `local` stops its peers (15 s grace each) before it exits
Toml = dict[str, dict[str, ConfigValue]]


@dataclasses.dataclass
class Step:
    key: str  # what --only names: 125m, 1b, swarm
    name: str  # the row's name
    command: str  # train-local or local
    config: Toml  # the config file's sections
    steps: int
    timeout_s: float
    log_every: int = 10  # train-local's --log-every
    layout: LocalSwarm | None = None  # local's processes
    versus: str | None = None  # the train-local step whose tokens/s this row's is divided by (ratio)
    rounds: bool = True  # a swarm that must do outer rounds (one with a single replica per stage has none)

    @property
    def swarm(self) -> bool:
        return self.command == "local"


def plan(cpu: bool, microbatch_1b: int) -> list[Step]:
    """The four steps: real sizes for a GPU, or the same steps at toy sizes (``cpu``)."""
    if cpu:  # a 64-wide, 2-block model (the tests' tiny one) and a 128-wide, 4-block one, on 64-token sequences
        toy = {"d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 64}
        deeper = {"d_model": 128, "n_layers": 4, "n_heads": 4, "max_seq_len": 64}
        train = {"seq_len": 64, "microbatch_size": 8, "inner_batch": 8, "precision": "fp32"}  # CPU bf16: emulated, slow
        inner = {"warmup_steps": 5}
        swarm = LocalSwarm(peers=4, stages=2, trainers=2, steps=20)
        stages = {"num_stages": swarm.stages}
        return [
            Step(
                "125m",
                "train-local toy",
                "train-local",
                {"model": toy, "stages": stages, "train": train, "inner": inner},
                30,
                60,
            ),
            Step(
                "1b",
                "train-local toy-deep",
                "train-local",
                {"model": deeper, "stages": stages, "train": {**train, "microbatch_size": 4}, "inner": inner},
                16,
                60,
                log_every=4,
            ),
            Step(
                "swarm",
                "swarm toy K=2",
                "local",
                {
                    "model": toy,
                    "stages": stages,
                    "train": train,
                    "inner": inner,
                    "outer": {"inner_steps": 5, "warm_start_steps": 0},
                },
                swarm.steps,
                120,
                layout=swarm,
                versus="125m",
            ),
            pipeline_step("swarm toy 1x2", {"model": toy, "train": train, "inner": inner}, 20, 90),
        ]
    train = {"seq_len": 1024, "microbatch_size": 8, "inner_batch": 16, "precision": "bf16"}
    swarm = LocalSwarm(peers=6, stages=2, trainers=2, steps=30)  # 2 trainers, 2 servers for each of 2 stages
    return [
        Step("125m", "train-local 125m", "train-local", {"model": {"preset": "125m"}, "train": train}, 50, 80),
        Step(
            "1b",
            "train-local 1b",
            "train-local",
            {"model": {"preset": "1b"}, "train": {**train, "microbatch_size": microbatch_1b}},
            20,
            110,
            log_every=5,
        ),
        Step(
            "swarm",
            "swarm 125m K=2",
            "local",
            {
                "model": {"preset": "125m"},
                "stages": {"num_stages": swarm.stages},
                "train": train,
                "outer": {"inner_steps": 5, "warm_start_steps": 0},
            },
            swarm.steps,
            150,
            layout=swarm,
            versus="125m",
        ),
        pipeline_step("swarm 125m 1x2", {"model": {"preset": "125m"}, "train": train}, 30, 110),
    ]


def pipeline_step(name: str, config: Toml, steps: int, timeout_s: float) -> Step:
    """``swarm1x2``: 1 trainer and a server for each of 2 stages sharing the device, no outer step (one replica per
    stage), at the shapes of the ``125m`` step's train-local, which its tokens/s is divided by."""
    layout = LocalSwarm(peers=3, stages=2, trainers=1, steps=steps)
    config = {**config, "stages": {"num_stages": layout.stages}, "outer": {"method": "none"}}
    return Step("swarm1x2", name, "local", config, steps, timeout_s, layout=layout, versus="125m", rounds=False)


def with_overrides(config: Toml, overrides: Mapping[str, ConfigValue]) -> Toml:
    """``config`` with ``--set`` SECTION.FIELD=VALUE pairs over it (a top-level field: FIELD=VALUE)."""
    merged: Toml = {section: dict(fields) for section, fields in config.items()}
    for path, value in overrides.items():
        section, _, field = path.rpartition(".")
        merged.setdefault(section, {})[field] = value
    return merged


def toml_text(config: Toml) -> str:
    """A swarm.toml with just these fields (the rest: the config's defaults, and the preset's)."""

    def value(v: ConfigValue) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        return json.dumps(v) if isinstance(v, str) else repr(v)

    top = [f"{field} = {value(v)}" for field, v in config.get("", {}).items()]
    sections = [
        "\n".join([f"[{name}]", *(f"{field} = {value(v)}" for field, v in fields.items())])
        for name, fields in config.items()
        if name
    ]
    return "\n\n".join(filter(None, ["\n".join(top), *sections])) + "\n"


def write_config(step: Step, out: Path, overrides: Mapping[str, ConfigValue]) -> tuple[Path, SwarmConfig]:
    path = out / f"{step.key}.toml"
    path.write_text(toml_text(with_overrides(step.config, overrides)))
    return path, load_config(path)  # refused here, with the field named, before any process starts


def command(step: Step, config: Path, out: Path, device: str, data: list[str], compile: str = "auto") -> list[str]:
    where = ["--config", str(config), "--out", str(out / step.key), "--device", device, "--compile", compile]
    where += [arg for spec in data for arg in ("--data", spec)]
    if step.swarm:
        assert step.layout is not None
        layout = ["--peers", str(step.layout.peers), "--stages", str(step.layout.stages)]
        layout += ["--trainers", str(step.layout.trainers), "--steps", str(step.steps)]
        return [sys.executable, "-m", "peer", "local", *layout, *where]
    return [
        sys.executable,
        "-m",
        "peer",
        "train-local",
        "--steps",
        str(step.steps),
        "--log-every",
        str(step.log_every),
    ] + where


# running a step


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, whatever its process group (a `local`'s peers, their DHT and daemons)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):  # gone while we looked
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # "pid (comm) state ppid …"
            children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def stop(proc: subprocess.Popen) -> None:
    """A step past its timeout: SIGINT (a `local` then stops its peers itself), then SIGKILL whatever it started."""
    offspring = descendants(proc.pid)  # found before their parent goes
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in offspring:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def is_progress(line: str) -> bool:
    """train-local's progress bar, a `local` trainer's step line, or an error worth seeing as it happens."""
    return (
        (" step " in line and "/" in line) or line.startswith(("Error", "error", "Traceback")) or "exited with" in line
    )


def run_logged(
    argv: list[str], log: Path, timeout_s: float, echo: Callable[[str], None], label: str, env: Mapping[str, str] = {}
) -> tuple[int | None, float]:
    """Run ``argv`` with its output in ``log`` (and ``env`` over this process's), echoing its progress lines; (exit
    status or None on timeout, wall s)."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, **env}
    with log.open("w") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
    started = last_beat = time.monotonic()
    offset = 0
    try:
        while True:
            code = proc.poll()
            with log.open() as f:
                f.seek(offset)
                for line in f:
                    if line.endswith("\n") and is_progress(line):
                        echo(f"  [{label}] {line.strip()}")
                    if not line.endswith("\n"):
                        break
                    offset += len(line.encode())
            now = time.monotonic()
            if code is not None:
                return code, now - started
            if now - started > timeout_s:
                echo(f"  [{label}] timed out after {timeout_s:.0f}s: stopping it")
                stop(proc)
                return None, time.monotonic() - started
            if now - last_beat >= 30:
                echo(f"  [{label}] running {now - started:.0f}s (timeout {timeout_s:.0f}s)")
                last_beat = now
            time.sleep(0.5)
    except BaseException:  # Ctrl+C on the check: no step outlives it
        if proc.poll() is None:
            stop(proc)
        raise


# reading what a step left


def jsonl(path: Path) -> list[dict[str, Any]]:
    """A metrics file's complete lines (a killed writer may leave half of one)."""
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(line) for line in lines]


def flops_per_token(cfg: SwarmConfig) -> float:
    """6N + 12·layers·d·T: the training FLOPs of a token, N the parameters but the embedding table's (a lookup)."""
    m = cfg.model
    n = model_parameters(m) - m.vocab_size * (m.subspace_rank or m.d_model)
    return 6 * n + 12 * m.n_layers * m.d_model * cfg.train.seq_len


def steady_tokens_per_s(records: list[dict[str, Any]]) -> float:
    """Tokens/s of a run's progress records after the first logged window (the device warming up, compiling),
    validation time left out; a run with one record: over all of it."""
    first, last = records[0], records[-1]
    train_s = lambda r: r["elapsed_s"] - r.get("eval_s", 0.0)
    if len(records) > 1 and train_s(last) > train_s(first):
        return float((last["tokens"] - first["tokens"]) / (train_s(last) - train_s(first)))
    return float(last["tokens"] / max(train_s(last), 1e-9))


def mfu(cfg: SwarmConfig, tokens_per_s: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation: ``flops_per_token`` × tokens/s ÷ the peak (None where no peak is known: a CPU)."""
    return flops_per_token(cfg) * tokens_per_s / (peak_tflops * 1e12) if peak_tflops else None


def train_local_result(records: list[dict[str, Any]], cfg: SwarmConfig, peak_tflops: float | None) -> dict[str, Any]:
    """Loss, throughput (``steady_tokens_per_s``), MFU and memory from train-local's metrics.jsonl."""
    if not records:
        return {}
    first, last = records[0], records[-1]
    tokens_per_s = steady_tokens_per_s(records)
    fpt = flops_per_token(cfg)
    return {
        "steps_done": last["step"],
        "tokens": last["tokens"],
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_overall": last["tokens_per_s"],  # warm-up and validation included
        "flops_per_token": fpt,
        "mfu": mfu(cfg, tokens_per_s, peak_tflops),
        "compile_s": last.get("compile_s"),  # the blocks' first forward, when compiled
        "peak_gpu_mb": last.get("peak_gpu_mb"),
        "loss_start": first["train_loss"],
        "loss_end": last["train_loss"],
        "val_loss_start": first["val_loss"],
        "val_loss_end": last["val_loss"],
        "records": len(records),
    }


def swarm_result(out: Path, layout: LocalSwarm, cfg: SwarmConfig, peak_tflops: float | None) -> dict[str, Any]:
    """The swarm's throughput (its trainers' ``steady_tokens_per_s`` together, as train-local's is measured), MFU,
    hops and rounds (``swarmtest.bench.swarm_summary``), its trainers' first and last windows' loss (mean over
    trainers), every peer's peak GPU memory."""
    peers = {name: records for name, records in read_peers(out).items() if records}
    trainers = [f"trainer-{i}" for i in range(layout.trainers)]
    progress = {
        name: [
            r for r in of_kind(peers.get(name, []), Progress) if r.role == "trainer" and r.get("train_loss") is not None
        ]
        for name in trainers
    }
    stamps = {name: [r.stamp for r in records if r.stamp] for name, records in peers.items()}
    result: dict[str, Any] = {
        "peak_gpu_mb_per_peer": {
            name: max((s.peak_gpu_mb for s in peer if s.peak_gpu_mb is not None), default=None)
            for name, peer in stamps.items()
        },
        "peak_rss_mb_per_peer": {
            name: max((s.peak_rss_mb or 0.0 for s in peer), default=None) for name, peer in stamps.items()
        },
    }
    gpu = [v for v in result["peak_gpu_mb_per_peer"].values() if v is not None]
    result["peak_gpu_mb"] = max(gpu, default=None)
    result["peak_gpu_mb_sum"] = sum(gpu) if gpu else None
    if all(progress.values()):
        result["loss_start"] = sum(p[0]["train_loss"] for p in progress.values()) / len(progress)
        result["loss_end"] = sum(p[-1]["train_loss"] for p in progress.values()) / len(progress)
        result["steps_done"] = min(p[-1]["step"] for p in progress.values())
        summary = swarm_summary(peers, layout)
        rounds = summary["outer_rounds"]  # per stage: the rounds completed
        tokens_per_s = sum(steady_tokens_per_s([r.fields for r in p]) for p in progress.values())
        result |= {
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_overall": summary["tokens_per_s"],  # the first window (warm-up, compiling) included
            "mfu": mfu(cfg, tokens_per_s, peak_tflops),
            "tokens": summary["tokens"],
            "val_loss_end": summary["val_loss"],
            "failed_hops": summary["failed_hops"],
            "skipped_hops": summary["skipped_hops"],
            "outer_rounds_per_stage": rounds,
            "outer_rounds": min((rounds.get(str(s), 0) for s in range(layout.stages + 1)), default=0),
            "round_members": summary["round_members"],
            "round_s": summary["round_s"],
            "outer_failed_or_late": summary["outer_failed_or_late"],
            "microbatches": summary["microbatches"],
        }
    return result


def problems(step: Step, code: int | None, result: dict[str, Any]) -> list[str]:
    """What went wrong in a step; none: ok."""
    if code is None:
        found = [f"timeout {step.timeout_s:.0f}s"]
    elif code != 0:
        found = [f"exit {code}"]
    else:
        found = []
    if "loss_end" not in result:
        return [*found, "no progress records"]
    if result.get("steps_done", 0) < step.steps:
        found.append(f"{result.get('steps_done', 0)}/{step.steps} steps")
    if not result["loss_end"] < result["loss_start"]:
        found.append("loss did not fall")
    if step.swarm:
        if "tokens_per_s" not in result:
            found.append("no summary")
        else:
            if step.rounds and result["outer_rounds"] < 1:
                found.append("no outer rounds")
            if result["failed_hops"]:
                found.append(f"{result['failed_hops']} failed hops")
    return found


# the table

COLUMNS = (
    ("step", 22, lambda r: r["step"]),
    ("tok/s", 9, lambda r: num(r.get("tokens_per_s"), ".0f")),
    ("MFU", 6, lambda r: "n/a" if r.get("mfu") is None and "tokens_per_s" in r else num(r.get("mfu"), ".1%")),
    ("ratio", 5, lambda r: num(r.get("ratio"), ".2f")),  # tokens/s ÷ the train-local row's at the same shapes
    ("peak GPU MB", 11, lambda r: num(r.get("peak_gpu_mb"), ".0f")),
    (
        "loss start→end",
        15,
        lambda r: f"{r['loss_start']:.3f}→{r['loss_end']:.3f}" if "loss_end" in r else "–",
    ),
    ("rounds", 6, lambda r: num(r.get("outer_rounds"), "d")),
    ("failed hops", 11, lambda r: num(r.get("failed_hops"), "d")),
    ("wall s", 7, lambda r: num(r.get("wall_s"), ".1f")),
    ("status", 0, lambda r: r["status"]),
)


def num(value: float | int | None, spec: str, unit: str = "") -> str:
    return "–" if value is None else format(value, spec) + unit


def table(rows: list[dict[str, Any]]) -> list[str]:
    def line(cells: list[str]) -> str:
        return " ".join(
            cell.ljust(width) if i == 0 else cell.rjust(width) if width else cell
            for i, (cell, (_, width, _)) in enumerate(zip(cells, COLUMNS))
        )

    return [line([name for name, _, _ in COLUMNS])] + [line([cell(r) for _, _, cell in COLUMNS]) for r in rows]


def add_ratios(rows: list[dict[str, Any]], steps: list[Step]) -> None:
    """Each row whose step names a train-local step (``versus``) gets ``ratio``: its tokens/s ÷ that step's row's,
    measured in the same run (None where either has none)."""
    by_key = {row["key"]: row for row in rows}
    for row, step in zip(rows, steps, strict=True):
        ref = by_key.get(step.versus) if step.versus else None
        if ref is not None and row.get("tokens_per_s") and ref.get("tokens_per_s"):
            row["ratio"], row["versus"] = row["tokens_per_s"] / ref["tokens_per_s"], step.versus


# the host


def preflight(cpu: bool, device: str) -> dict[str, Any]:
    """torch and the GPU, asked in a child process (this one never touches CUDA, so its memory stays the steps')."""
    probe = (
        "import json, torch\n"
        "info = {'torch': torch.__version__, 'cuda_available': torch.cuda.is_available()}\n"
        f"if {not cpu} and torch.cuda.is_available():\n"
        f"    d = torch.device({device!r} if {device!r} != 'auto' else 'cuda')\n"
        "    free, total = torch.cuda.mem_get_info(d)\n"
        "    info |= {'gpu': torch.cuda.get_device_name(d), 'gpu_free_mb': free / 2**20, 'gpu_total_mb': total / 2**20,\n"
        "             'cuda': torch.version.cuda, 'bf16': torch.cuda.is_bf16_supported()}\n"
        "print(json.dumps(info))\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=PREFLIGHT_TIMEOUT_S, cwd=REPO
        )
    except subprocess.TimeoutExpired:
        return {"error": f"the torch probe took over {PREFLIGHT_TIMEOUT_S}s"}
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def peak_for(gpu: str | None, given: float | None) -> float | None:
    """The bf16 dense peak in TFLOP/s: ``--peak-tflops``, else by the GPU's name."""
    if given:
        return given
    return next((peak for name, peak in PEAK_TFLOPS if gpu and name in gpu), None)


def microbatch_for_1b(free_mb: float | None, out: Path, overrides: Mapping[str, ConfigValue]) -> int:
    """8, unless the whole 1b model's estimate at 8 x 1024 passes the GPU's free memory: then 4."""
    if free_mb is None:
        return 8
    _, cfg = write_config(next(s for s in plan(False, 8) if s.key == "1b"), out, overrides)  # the step rewrites it
    return 8 if StageFootprint.whole_model(cfg).total_bytes / 2**20 <= free_mb else 4


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="the same steps at toy sizes on the CPU (CI)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "gpu-check", help="configs, logs and metrics")
    parser.add_argument("--json", type=Path, help="write the rows and the table here (default: OUT/gpu_check.json)")
    parser.add_argument("--only", nargs="+", choices=("125m", "1b", "swarm", "swarm1x2"), help="run these steps only")
    add_field_arguments(parser, PeerConfig, "compile")  # every process's
    parser.add_argument("--device", help="where the steps compute (default: cuda; with --cpu, cpu)")
    parser.add_argument("--peak-tflops", type=float, help="the GPU's bf16 dense peak for MFU (default: by its name)")
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every step's timeout")
    parser.add_argument(
        "--budget",
        type=float,
        default=BUDGET_S,
        help="seconds for the whole check: a step's timeout is cut to what is left of it (default: %(default)s)",
    )
    add_field_arguments(parser, PeerConfig, "data")  # every step's
    parser.add_argument(
        "--set", nargs="+", default=[], metavar="PATH=VALUE", help="config overrides for every step (inner.lr=3e-4)"
    )
    parser.add_argument("--dry-run", action="store_true", help="write the configs and print the plan; run nothing")
    args = parser.parse_args()
    device = args.device or ("cpu" if args.cpu else "cuda")
    data = args.data or ([str(Path(sysconfig.get_paths()["stdlib"]) / "email")] if args.cpu else [])
    try:
        overrides = parse_overrides(args.set)
    except ValueError as e:
        parser.error(str(e))
    out = args.out.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    json_path = args.json or out / "gpu_check.json"
    echo = lambda line: print(line, flush=True)
    started = time.monotonic()

    host = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    if not args.dry_run:
        host |= preflight(args.cpu, device)
        if "error" in host:
            echo(f"gpu_check: torch does not load: {host['error']}")
            return 2
        if device.startswith("cuda") and not host.get("cuda_available"):
            echo("gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); --cpu runs the toy sizes")
            return 2
    peak = peak_for(host.get("gpu"), args.peak_tflops)
    microbatch = 8 if args.cpu else microbatch_for_1b(host.get("gpu_free_mb"), out, overrides)
    steps = [s for s in plan(args.cpu, microbatch) if not args.only or s.key in args.only]
    for s in steps:
        s.timeout_s *= args.timeout_scale
    gpu = host.get("gpu")
    echo(
        f"gpu_check: {'cpu (toy sizes)' if args.cpu else device} "
        + (f"{gpu}, {host['gpu_free_mb']:.0f} of {host['gpu_total_mb']:.0f} MB free, " if gpu else "")
        + f"torch {host.get('torch', '?')}; MFU peak {num(peak, '.0f')} TFLOP/s; "
        f"{len(steps)} steps within {sum(s.timeout_s for s in steps):.0f}s of timeouts; logs in {out}"
    )
    rows: list[dict[str, Any]] = []
    for index, step in enumerate(steps, 1):
        try:
            config, cfg = write_config(step, out, overrides)
        except Exception as e:  # a --set the config refuses: said once, by field
            echo(f"gpu_check: {step.name}: the config is refused: {e}")
            return 2
        argv = command(step, config, out, device, data, args.compile)
        m, t = cfg.train, cfg.model
        shape = f"{model_parameters(t) / 1e6:.1f}M params, d {t.d_model} x {t.n_layers} layers, {m.precision}, "
        shape += f"microbatch {m.microbatch_size} x {m.seq_len}, inner batch {m.inner_batch}"
        if step.layout:
            servers = step.layout.peers - step.layout.trainers
            trainers = f"{step.layout.trainers} trainer" + "s" * (step.layout.trainers != 1)
            shape += f", {trainers} + {servers} servers over {step.layout.stages} stages"
            shape += (
                f", outer round every {cfg.outer.inner_steps} steps"
                if cfg.outer.method != "none"
                else ", no outer step"
            )
        log = out / f"{step.key}.log"
        echo(
            f"gpu_check [{index}/{len(steps)}] {step.name}: {shape}, {step.steps} steps, timeout {step.timeout_s:.0f}s"
        )
        echo(f"  $ {' '.join(argv)}  > {log}")
        if args.dry_run:
            what = (
                [StageFootprint.of(cfg, stage).describe() for stage in range(cfg.stages.num_stages + 1)]
                if step.swarm
                else [StageFootprint.whole_model(cfg).describe()]
            )
            for line in what:
                echo(f"  {line}")
            continue
        left = args.budget - (time.monotonic() - started) - STOP_GRACE_S  # a timed-out step's stop fits in too
        if left < min(step.timeout_s, 10):
            status = f"skipped: {max(left + STOP_GRACE_S, 0):.0f}s of --budget left"
            rows.append({"step": step.name, "key": step.key, "steps": step.steps, "status": status})
            echo(f"  [{step.key}] {status}")
            continue
        if left < step.timeout_s:
            echo(f"  [{step.key}] timeout cut to {left:.0f}s by --budget {args.budget:.0f}")
            step.timeout_s = left
        # toy sizes on a CPU: one torch thread per process (two on a busy 2-core machine spin: 10x slower)
        env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")} if device == "cpu" else {}
        code, wall_s = run_logged(argv, log, step.timeout_s, echo, step.key, env)
        try:
            if step.swarm:
                assert step.layout is not None
                result = swarm_result(out / step.key, step.layout, cfg, peak)
            else:
                result = train_local_result(jsonl(out / step.key / "metrics.jsonl"), cfg, peak)
        except Exception as e:  # a run that left odd records still gets its row
            result = {"parse_error": f"{type(e).__name__}: {e}"}
        found = problems(step, code, result) + ([result["parse_error"]] if "parse_error" in result else [])
        row = {
            "step": step.name,
            "key": step.key,
            "command": argv,
            "config": str(config),
            "log": str(log),
            "shape": shape,
            "steps": step.steps,
            "timeout_s": step.timeout_s,
            "exit": code,
            "wall_s": wall_s,
            **result,
            "status": "ok" if not found else "; ".join(found),
        }
        rows.append(row)
        echo(f"  [{step.key}] {row['status']} in {wall_s:.1f}s")
        if found:
            tail = log.read_text(errors="replace").splitlines()[-8:]
            echo("\n".join(f"  [{step.key}] | {line}" for line in tail))
    if args.dry_run:
        return 0
    add_ratios(rows, steps)
    lines = table(rows)
    echo("")
    echo("\n".join(lines))
    total = time.monotonic() - started
    echo(f"total {total:.0f}s")
    report = {
        "mode": "cpu" if args.cpu else "gpu",
        "device": device,
        "host": host,
        "peak_tflops": peak,  # None: MFU n/a (a CPU has no stated peak here)
        "compile": args.compile,
        "overrides": {k: v for k, v in overrides.items()},
        "total_s": total,
        "table": lines,
        "rows": rows,
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1))
    echo(f"wrote {json_path}")
    return 0 if rows and all(r["status"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
