"""Start peers: one in this process (``swarmloco run``), or a whole swarm of processes on loopback (``swarmloco local``).

``run_peer`` wires the pieces swarm/ leaves to its caller: the corpus, a JSONL metrics file,
signals. ``launch_local`` starts every peer as a separate ``swarmloco run`` process in its own
process group (so its DHT and libp2p daemon go down with it): the first stage server creates the
swarm, the others join through it and fetch the config. It prints the trainers' progress and,
once they finish, stops the servers.

    $ swarmloco run --role stage --stage 1 --config swarm.toml          # prints the address to join through
    $ swarmloco run --role trainer --initial-peers /ip4/…/p2p/12D3…
    $ swarmloco local --peers 3 --stages 2 --steps 100 --out runs/local

The layout of a local swarm and each peer's config are ``peer/local_swarm.py``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

import torch

from peer import logs
from peer.data import Shard, load_corpus, resolve_paths
from peer.local_swarm import LocalSwarm, local_config, peer_roles, stage0_file
from peer.progress import elapsed_and_eta
from peer.tokenizer import check_tokenizer, load_tokenizer, tokenizer_for, with_tokenizer
from swarm.config import SwarmConfig
from swarm.config_toml import load_config, save_config
from swarm.events import Event, Progress, Spawned, StageProgress, Stamp, TrainerProgress, Training, of_kind, read_events
from swarm.hardware import peak_gpu_memory
from swarm.node.config import PeerConfig
from swarm.node.node import Node

REPO_ROOT = Path(__file__).resolve().parents[1]
READY_PREFIX = "swarmloco: join with --initial-peers "


def run_peer(peer: PeerConfig, *, config: Path | None = None, echo: Callable[[str], None] = print) -> Progress | None:
    """Run one peer (``config``: the swarm.toml of a swarm it creates or checks) until it is done (trainer) or gets
    SIGINT/SIGTERM; returns its last progress record (None if stopped before one)."""
    if peer.threads:
        torch.set_num_threads(peer.threads)
    tokenizer = load_tokenizer(peer.tokenizer)  # fail on a bad file before joining
    cfg = load_config(config) if config else (None if peer.initial_peers else with_tokenizer(SwarmConfig(), tokenizer))
    if cfg is not None and peer.role in ("trainer", "full"):  # --role auto: once it turns out to be a trainer
        check_tokenizer(cfg, tokenizer, peer.tokenizer)
    name = (
        peer.name
        or {"trainer": "trainer", "full": "full", "stage": f"stage{peer.stage or ''}"}.get(peer.role, "peer")
        + f"-{os.getpid()}"
    )
    peer = dataclasses.replace(peer, name=name)
    logs.set_peer_name(name)
    if peer.role in ("trainer", "full") and peer.data:
        resolve_paths(peer.data)  # fail on bad --data before joining
    echo(f"{name}: {peer.chosen_reachability().describe()}")

    def batches(cfg: SwarmConfig, peer_id: str) -> tuple[Any, list[Any]]:
        """Read this trainer's shard once it knows the swarm's config and its own peer id."""
        count = cfg.data.shards
        shard = Shard.of_peer(peer_id, count) if peer.data_shard is None else Shard(index=peer.data_shard, count=count)
        corpus = load_corpus(peer.data, tokenizer=tokenizer_for(cfg, peer.tokenizer), shard=shard)
        echo(
            f"{name}: data shard {shard.index} of {count}: {len(corpus.train)} training and {len(corpus.val)} "
            f"validation tokens from {corpus.num_documents} documents"
        )
        kw = dict(batch_size=cfg.train.microbatch_size, seq_len=cfg.train.seq_len)
        return corpus.sample_batches("train", seed=cfg.train.seed + 1000 * peer.seed, **kw), corpus.val_batches(**kw)

    def on_ready(maddrs: list[str]) -> None:
        loopback_last = sorted(maddrs, key=lambda m: "/127.0.0.1/" in m)  # a routable address first
        echo(f"{name}: {peer.role} of swarm ready")
        echo(READY_PREFIX + " ".join(loopback_last))

    metrics: TextIO | None = None
    if peer.out is not None:
        peer.out.mkdir(parents=True, exist_ok=True)
        metrics = (peer.out / f"{name}.jsonl").open("a")

    def on_log(event: Event) -> None:
        # peak_rss_mb: the process' high-water mark so far (ru_maxrss is in KiB on Linux)
        peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        # peak_gpu_mb: once this process has used CUDA
        stamped = event.stamped(
            Stamp(time=time.time(), peer=name, peak_rss_mb=round(peak_rss_mb, 1), **peak_gpu_memory())
        )
        if metrics is not None:
            metrics.write(json.dumps(stamped.to_record()) + "\n")
            metrics.flush()
        if isinstance(stamped, Training):  # a trainer's or full peer's progress, not outer-step events
            echo(progress_line(stamped, peer.steps))

    async def main() -> Progress | None:
        node = Node(peer, cfg, data=batches, on_log=on_log, on_ready=on_ready)
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, lambda: asyncio.ensure_future(node.stop()))
        return await node.run()

    try:
        return asyncio.run(main())
    finally:
        if metrics is not None:
            metrics.close()


def progress_line(record: Training, steps: int) -> str:
    loss = "-" if record.train_loss is None else f"{record.train_loss:.3f}"
    val = f"  val {record.val_loss:.3f}" if record.val_loss is not None else ""
    pipeline = (  # a full peer's microbatches take no path
        f"done {record.pipeline.completed} failed {record.pipeline.failed} skipped hops {record.pipeline.skipped_hops}  "
        if isinstance(record, TrainerProgress)
        else "full model  "
    )
    who = record.stamp.peer if record.stamp else "?"
    return (
        f"[{who}] step {record.step}/{steps}  loss {loss}{val}  {record.tokens_per_s / 1000:.1f}k tok/s  "
        f"{pipeline}{elapsed_and_eta(record.elapsed_s, done=record.step, total=steps)}"
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a peer process runs: a command prefix (e.g. ``ip netns exec NS`` for the WAN lab), the address it listens
    on, and options of its own (e.g. ``--reachability relay`` for a host behind a firewall)."""

    prefix: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    args: tuple[str, ...] = ()


LOOPBACK = Placement()


def launch_local(
    layout: LocalSwarm,
    *,
    out: Path,
    config: SwarmConfig | None = None,
    peer: PeerConfig | None = None,
    extra_args: Sequence[str] = (),
    echo: Callable[[str], None] = print,
    ready_timeout_s: float = 120.0,
    place: Callable[[str], Placement] = lambda name: LOOPBACK,
    export: bool = True,
    schedule_set: bool = False,
) -> int:
    """Run a whole swarm until its trainers finish; 0 if every trainer succeeded.

    Every peer's config is ``peer`` (its data, tokenizer, device, ...: the ``swarmloco run`` options all peers share;
    one torch thread unless it sets ``threads``) with its role's fields set (``peer_roles``), handed over as the argv that recreates it (``PeerConfig.to_argv``),
    then ``extra_args``. With several trainers, each reads its own data shard (``local_config``); the tokenizer is
    the file the config names; ``schedule_set``: the config sets ``inner.total_steps``, which the run then keeps
    (else it is the run's steps). Every peer runs on loopback unless ``place`` (peer name -> Placement) puts it elsewhere. The
    peers run in ``out``, so every path handed to them is made absolute first. With ``export``, the
    model is saved to ``out/model.pt`` before the servers stop: stage 0 as the first trainer left it
    (each trainer writes ``out/<name>.stage0``), the middle stages from their live servers.
    """
    out = out.expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg = local_config(config or SwarmConfig(), layout, schedule_set=schedule_set)
    save_config(cfg, out / "swarm.toml")
    base = peer or PeerConfig()
    tokenizer = None if base.tokenizer is None else Path(absolute_spec(str(base.tokenizer)))
    base = dataclasses.replace(
        base, out=out, threads=base.threads or 1, data=[absolute_spec(spec) for spec in base.data], tokenizer=tokenizer
    )
    common = ["--log-level", logs.current_level(), *extra_args]

    def spawn(name: str, role: PeerConfig, *args: str) -> subprocess.Popen:
        where = place(name)
        listen = dataclasses.replace(role, host_maddrs=[f"/ip4/{where.host}/tcp/0"])
        return spawn_peer(name, [*listen.to_argv(), *args, *where.args, *common], out, prefix=where.prefix)

    echo(
        f"local swarm {cfg.swarm_id}: {layout.trainers} trainer(s), {layout.peers - layout.trainers} stage servers over "
        f"{layout.stages} stages, {layout.full} full peer(s), {layout.steps} steps, {layout.joiners} late joiner(s); "
        f"logs and metrics in {out}"
    )
    procs: dict[str, subprocess.Popen] = {}
    # SIGTERM (a `timeout`, a service manager) must stop the peers too, as Ctrl-C does: its default action ends this
    # process without the ``finally`` below, and every peer went on running as an orphan
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        (first, first_role), *others = peer_roles(layout, cfg, out, base)  # the first creates the swarm
        procs[first] = spawn(first, first_role, "--config", str(out / "swarm.toml"))
        address = wait_for_address(procs[first], out / f"{first}.log", ready_timeout_s)
        for line in watch_commands(address, cfg.name):
            echo(line)
        for name, role in others:  # the others join it
            procs[name] = spawn(name, dataclasses.replace(role, initial_peers=[address]))
        trainers = [f"trainer-{i}" for i in range(layout.trainers)]
        full = [f"full-{i}" for i in range(layout.full)]
        joiners = [f"joiner-{i}" for i in range(layout.joiners)]
        join_at: list[float] = []  # (monotonic) when the joiners start

        def start_joiners() -> None:  # join_after_s once every trainer has logged progress: the swarm is running
            if joiners and not join_at and all(has_trained(out / f"{name}.jsonl") for name in trainers):
                join_at.append(time.monotonic() + layout.join_after_s)
            while joiners and join_at and time.monotonic() >= join_at[0]:
                name = joiners.pop(0)
                procs[name] = spawn(
                    name, dataclasses.replace(base, role="auto", steps=layout.steps, initial_peers=[address])
                )
                echo(f"{name} joins the running swarm")

        codes = follow_trainers({name: procs[name] for name in trainers + full}, out, echo, tick=start_joiners)
        if export:
            finished = [name for name in trainers if codes[name] == 0]
            export_model(address, cfg, out, finished, echo, tokenizer=base.tokenizer)
    finally:
        stop_processes(procs.values())
    for name, code in codes.items():
        if code != 0:
            echo(f"{name} exited with status {code}; see {out / f'{name}.log'}")
    for line in summary(out, list(procs)):
        echo(line)
    echo(f"swarm stopped; per-peer metrics in {out}/<peer>.jsonl, logs in {out}/<peer>.log")
    return max(codes.values(), key=abs)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def export_model(
    address: str,
    cfg: SwarmConfig,
    out: Path,
    finished: Sequence[str],
    echo: Callable[[str], None],
    *,
    tokenizer: Path | None = None,
) -> None:
    """Save the swarm's model to ``out/model.pt`` while its servers still run: stage 0 from the first finished
    trainer's saved file, the middle stages from the swarm; then as a Hugging Face LLaMA folder, ``out/model-hf``
    (with ``tokenizer``), where the model has that form. A failure is reported, not raised: training is done."""
    from peer.export import export_checkpoint, export_swarm
    from swarm.recovery.rebuild import load_stage_checkpoint

    saved = [stage0_file(out, name) for name in finished if stage0_file(out, name).exists()]
    if not saved:
        echo("no model exported: no trainer finished and saved stage 0")
        return
    path = out / "model.pt"
    try:
        stage0 = load_stage_checkpoint(saved[0], cfg, 0)
        asyncio.run(export_swarm([address], cfg, path, name=cfg.name, have={0: stage0}, on_progress=lambda line: None))
    except Exception as e:  # the export is a convenience at the end: say why it failed, keep the run's outcome
        echo(f"could not export the model: {type(e).__name__}: {e}; the stages' logs are in {out}")
        return
    echo(f"model saved: {path}  (swarmloco eval --checkpoint {path}; swarmloco sample --checkpoint {path})")
    if cfg.model.subspace_rank:  # a subspace-constrained residual stream has no LLaMA form
        return
    try:
        export_checkpoint(path, out / "model-hf", format="hf", tokenizer=tokenizer)
    except Exception as e:
        echo(f"could not write the Hugging Face folder: {type(e).__name__}: {e}")
        return
    echo(f"Hugging Face folder: {out / 'model-hf'}  (transformers: LlamaForCausalLM.from_pretrained)")


def watch_commands(address: str, swarm: str) -> list[str]:
    """What a user pastes to watch, join or export this swarm while it runs: its address and ready commands."""
    named = "" if swarm == SwarmConfig().name else f" --swarm {swarm}"
    return [
        f"swarm address: {address}",
        f"  watch:  swarmloco dashboard --initial-peers {address}{named}",
        f"  status: swarmloco status --initial-peers {address}{named}",
        f"  join:   swarmloco run --initial-peers {address}{named}",
        f"  export: swarmloco export --initial-peers {address}{named} -o model.pt",
    ]


def last_records(out: Path, names: Iterable[str]) -> dict[str, Progress]:
    """Each peer's last progress record (a trainer's step, a server's counters) from ``out/<name>.jsonl``."""
    found = {}
    for name in names:
        if records := of_kind(read_events(out / f"{name}.jsonl"), Progress):
            found[name] = records[-1]
    return found


def summary(out: Path, names: Iterable[str]) -> list[str]:
    """What a user wants to know when the swarm stops: per peer, and the bytes on the wire by kind against fp32.

    Every pipeline hop starts and ends at a trainer, so the trainers' counters hold all activation
    traffic; pseudo-gradient bytes are what each replica received in its outer rounds.
    """
    records = last_records(out, names)
    lines = [
        f"{'peer':<12} {'role':<8} {'val_loss':>8} {'tokens':>9} {'tok/s':>7} {'failed':>6} {'skipped':>7} {'outer rounds':>12}"
    ]
    wire: Counter[str] = Counter()
    fp32: Counter[str] = Counter()
    for name, r in records.items():
        rounds = sum(r.count(f"outer_{outcome}") for outcome in ("done", "late", "failed"))
        if isinstance(r, Training):
            val = f"{r.val_loss:.4f}" if r.val_loss is not None else "-"
            pipeline = r.pipeline if isinstance(r, TrainerProgress) else None
            row = [
                r.role,
                val,
                r.tokens,
                f"{r.tokens_per_s:.0f}",
                pipeline.failed if pipeline else "-",
                pipeline.skipped_hops if pipeline else "-",
            ]
        else:
            row = [f"stage {r.stage}" if isinstance(r, StageProgress) else r.role, "-", "-", "-", "-", "-"]
        done = f"{r.count('outer_done')} of {rounds}"
        lines.append(f"{name:<12} {row[0]:<8} {row[1]:>8} {row[2]:>9} {row[3]:>7} {row[4]:>6} {row[5]:>7} {done:>12}")
        if isinstance(r, TrainerProgress):
            wire.update(r.wire_bytes)
            fp32.update(r.fp32_bytes)
        wire["pseudo_gradients"] += r.count("pseudo_grad_bytes")
        fp32["pseudo_gradients"] += r.count("pseudo_grad_fp32_bytes")
    kinds = []
    for kind, label in (
        ("activations", "activations"),
        ("gradients", "activation gradients"),
        ("pseudo_gradients", "pseudo-gradients"),
    ):
        against = f" ({fp32[kind] / wire[kind]:.1f}× less than fp32's {fp32[kind] / 1e6:.1f} MB)" if wire[kind] else ""
        kinds.append(f"{label} {wire[kind] / 1e6:.1f} MB{against}")
    return [*lines, "bytes on the wire: " + "; ".join(kinds)]


def absolute_spec(spec: str) -> str:
    """A ``--data`` spec (file, directory or glob) resolved against this process's directory, for a peer running elsewhere."""
    path = Path(spec).expanduser()
    return str(path if path.is_absolute() else Path.cwd() / path)


def has_trained(metrics: Path) -> bool:
    """Whether a trainer's metrics file holds a progress record yet."""
    return bool(of_kind(read_events(metrics), TrainerProgress))


def spawn_peer(name: str, args: list[str], out: Path, *, prefix: Sequence[str] = ()) -> subprocess.Popen:
    """A ``swarmloco run`` process in its own process group, output to ``out/<name>.log``; ``prefix`` wraps the command.

    Its metrics file ``out/<name>.jsonl`` starts with a ``spawned`` event: the time the process was
    started, from which e.g. the time to join is measured.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    with (out / f"{name}.jsonl").open("a") as metrics:
        metrics.write(json.dumps(Spawned(stamp=Stamp(time=time.time(), peer=name)).to_record()) + "\n")
    with (out / f"{name}.log").open("w") as log:
        return subprocess.Popen(
            [*prefix, sys.executable, "-m", "peer", "run", "--name", name, *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=out,
            start_new_session=True,
        )


def wait_for_address(proc: subprocess.Popen, log: Path, timeout_s: float) -> str:
    """The first multiaddr a starting peer prints."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith(READY_PREFIX):
                return line[len(READY_PREFIX) :].split()[0]
        if proc.poll() is not None:
            raise RuntimeError(
                f"the first peer exited with status {proc.returncode} before it was ready:\n{log.read_text()[-2000:]}"
            )
        time.sleep(0.2)
    raise TimeoutError(f"the first peer printed no address within {timeout_s:.0f}s; see {log}")


def follow_trainers(
    trainers: dict[str, subprocess.Popen],
    out: Path,
    echo: Callable[[str], None],
    tick: Callable[[], None] = lambda: None,
) -> dict[str, int]:
    """Echo the trainers' progress lines until they all exit, calling ``tick`` every half second; their exit statuses."""
    offsets = dict.fromkeys(trainers, 0)
    while True:
        tick()
        finished = all(proc.poll() is not None for proc in trainers.values())
        for name in trainers:
            log = out / f"{name}.log"
            if log.exists():
                with log.open() as f:
                    f.seek(offsets[name])
                    for line in f:
                        if line.startswith(f"[{name}]"):
                            echo(line.rstrip())
                    offsets[name] = f.tell()
        if finished:
            return {name: proc.returncode for name, proc in trainers.items()}
        time.sleep(0.5)


def stop_processes(procs: Iterable[subprocess.Popen], grace_s: float = 15.0) -> None:
    """SIGTERM each peer (it retires its records and stops its DHT), then SIGKILL its process group."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()  # the peer's main process only: its DHT must outlive it to retire records
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left: a stuck peer, its DHT process, its libp2p daemon
        proc.wait()
