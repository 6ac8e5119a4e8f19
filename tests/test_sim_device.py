"""The simulator's link codes on its device: no fp32 tensor moves to the host, and the swarm trains as before."""

import sysconfig
from pathlib import Path

import pytest
import torch

import compress.transfer as transfer
from compress.codecs import get_codec
from compress.config import CodecConfig
from optim.config import OuterOptimConfig
from peer.data import load_corpus
from swarm.errors import ConfigError
from swarm.pipeline.boundary import Link
from swarm.sim.simulate import SimulationConfig, SimulationResult, simulate
from swarmtest.configs import tiny_config

SEQ, MICRO = 32, 4


@pytest.fixture(scope="module")
def corpus():
    return load_corpus([Path(sysconfig.get_paths()["stdlib"]) / "json"])


def run(corpus, activations: str, gradients: str, **sim_options: object) -> SimulationResult:
    cfg = tiny_config(
        stages=2,
        model={"d_model": 32, "n_layers": 2, "n_heads": 2, "max_seq_len": SEQ},
        train={"seq_len": SEQ, "microbatch_size": MICRO, "inner_batch": MICRO},
        inner={"lr": 1e-2, "warmup_steps": 2},
        codecs=CodecConfig(activations=activations, gradients=gradients, pseudo_gradients="fp32"),
        outer=OuterOptimConfig(warm_start_steps=0, method="diloco", inner_steps=2),
    )
    streams = [corpus.sample_batches("train", batch_size=MICRO, seq_len=SEQ, seed=k) for k in range(2)]
    val = corpus.val_batches(batch_size=MICRO, seq_len=SEQ, num_sequences=MICRO)
    sim = SimulationConfig(replicas=2, tokens=5 * 2 * MICRO * SEQ, log_every=1, seed=3, **sim_options)
    return simulate(cfg, sim, streams, val)


def host_path_send(self: Link, kind: str, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """What ``Link.send`` did before the codecs ran on the device: the tensor to the host, decoded there, moved back."""
    frame = self.codecs[kind].encode(x.detach().cpu(), tokens=tokens)
    self.bytes[kind] += len(frame)
    self.messages[kind] += 1
    return self.codecs[kind].decode(frame).to(self.device)


@pytest.mark.parametrize(("activations", "gradients"), [("int8", "int8"), ("int4", "bf16"), ("fp16", "fp32")])
def test_the_simulator_trains_as_through_the_host_path(monkeypatch, corpus, activations: str, gradients: str) -> None:
    now = run(corpus, activations, gradients)
    with monkeypatch.context() as patch:
        patch.setattr(Link, "send", host_path_send)
        before = run(corpus, activations, gradients)
    assert [r["train_loss"] for r in now.log] == [r["train_loss"] for r in before.log]
    assert now.bytes_by_kind == before.bytes_by_kind
    for group, old in zip(now.replicas.values(), before.replicas.values()):
        for a, b in zip(group, old):
            assert all(torch.equal(p, q) for p, q in zip(a.module.parameters(), b.module.parameters()))


def test_the_link_moves_only_coded_bytes_to_the_host(monkeypatch, corpus) -> None:
    """Inside ``Link.send`` nothing calls ``.cpu()`` and only uint8 codes cross (``compress/transfer.py``)."""
    crossed: list[torch.dtype] = []
    gather, send, cpu = transfer._gather, Link.send, torch.Tensor.cpu
    inside = [False]

    def spying_send(self: Link, kind: str, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        inside[0] = True
        try:
            return send(self, kind, x, tokens)
        finally:
            inside[0] = False

    def guarded_cpu(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        assert not inside[0], f"Link.send moved a {self.dtype} tensor of shape {tuple(self.shape)} with .cpu()"
        return cpu(self, *args, **kwargs)

    monkeypatch.setattr(transfer, "_gather", lambda ts, copy: crossed.extend(t.dtype for t in ts) or gather(ts, copy))
    monkeypatch.setattr(Link, "send", spying_send)
    monkeypatch.setattr(torch.Tensor, "cpu", guarded_cpu)
    result = run(corpus, "int8", "bf16")
    assert result.messages_by_kind["activations"] > 0 and crossed and set(crossed) == {torch.uint8}


def test_a_link_decodes_onto_its_device(monkeypatch) -> None:
    placed: list[torch.device] = []
    to_device = transfer.to_device
    monkeypatch.setattr(
        "compress.codec_base.to_device", lambda body, device: placed.append(device) or to_device(body, device)
    )
    link = Link(get_codec("int8"), get_codec("bf16"), device=torch.device("cpu"))
    y = link.send("activations", torch.randn(2, 8, 16), torch.zeros(2, 8, dtype=torch.long))
    assert placed == [torch.device("cpu")] and y.device == torch.device("cpu")


def test_without_zstd_the_frames_stay_on_the_device_and_train_alike(corpus) -> None:
    """``wire_zstd=False``: the same training, the bytes counted before zstd (never fewer)."""
    counted, raw = run(corpus, "int8", "bf16"), run(corpus, "int8", "bf16", wire_zstd=False)
    assert [r["train_loss"] for r in raw.log] == [r["train_loss"] for r in counted.log]
    assert raw.messages_by_kind == counted.messages_by_kind
    for kind in ("activations", "activation_gradients"):
        assert raw.bytes_by_kind[kind] >= counted.bytes_by_kind[kind]
    assert raw.bytes_by_kind["activations"] > counted.bytes_by_kind["activations"]  # the embedding: zstd pays there


def test_every_replica_is_compiled_as_the_simulation_says(monkeypatch, corpus) -> None:
    import swarm.sim.simulate as simulate_module

    compiled: list[tuple[str, str]] = []

    def record(module: torch.nn.Module, mode: str, device: torch.device) -> None:
        compiled.append((type(module).__name__, mode))

    monkeypatch.setattr(simulate_module, "compile_stage", record)
    run(corpus, "fp32", "fp32", compile="on")
    # 2 replicas of each of the 3 stages (stage 0 and two middle ones), each handed "on"
    assert sorted(compiled) == sorted([("EdgeStage", "on")] * 2 + [("MiddleStage", "on")] * 4)
    with pytest.raises(ConfigError, match="compile"):
        SimulationConfig(compile="always")  # type: ignore[arg-type]
