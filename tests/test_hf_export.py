"""``swarmloco export --format hf``: the folder transformers loads computes swarmloco's logits.

From a saved checkpoint (in process and through the CLI from a train-local run) and from a running swarm; the
tokenizer goes along when given; subspace-constrained models and bad targets are refused with one clear line.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from peer.export import export_checkpoint, export_target
from peer.tokenizer import file_sha256
from swarm.config import SwarmConfig
from swarm.config_toml import save_config
from swarm.errors import ExportError
from swarm.model.hf import NotLlamaError, llama_config, rope_half_order, to_llama_state_dict
from swarm.model.transformer import ModelConfig, Transformer
from swarm.node.config import PeerConfig
from swarm.recovery.checkpoint import save_checkpoint
from swarmtest.configs import DATA, tiny_config
from swarmtest.processes import Swarm, swarmloco

transformers = pytest.importorskip("transformers")  # the dev extra: swarmloco itself never needs it

TOLERANCE = 1e-4  # max abs logit difference, fp32 both sides
# every config.json field away from its default, so a field left out or mapped wrong shows
ODD_MODEL = ModelConfig(
    vocab_size=300, d_model=64, n_layers=2, n_heads=4, ffn_mult=3.0, max_seq_len=64, rope_theta=500.0, norm_eps=1e-6
)


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(tokens).logits


def ours(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(tokens)


def trained(model: Transformer, steps: int = 5) -> Transformer:
    """A few AdamW steps on random tokens: weights off their init (norm gains no longer all ones)."""
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        tokens = torch.randint(0, model.cfg.vocab_size, (4, model.cfg.max_seq_len + 1), generator=g)
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    return model


def export(tmp_path: Path, cfg: SwarmConfig, model: Transformer, **options: object) -> Path:
    save_checkpoint(tmp_path / "model.pt", cfg, model, steps=5)
    out = tmp_path / "hf"
    export_checkpoint(tmp_path / "model.pt", out, format="hf", **options)
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("train", [False, True], ids=["at-init", "trained"])
def test_exported_llama_computes_swarmlocos_logits(tmp_path: Path, train: bool) -> None:
    model = Transformer(ODD_MODEL)
    model = trained(model) if train else model
    assert not train or not torch.equal(model.norm.weight, torch.ones(64))
    out = export(tmp_path, tiny_config(model=ODD_MODEL), model)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    config = transformers.AutoConfig.from_pretrained(out)
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (300, 64, ODD_MODEL.ffn_hidden)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (2, 4, 4)
    assert (config.rms_norm_eps, config.max_position_embeddings) == (1e-6, 64)
    assert config.rope_parameters["rope_theta"] == 500
    assert not config.tie_word_embeddings and config.hidden_act == "silu"

    tokens = torch.randint(0, 300, (3, 64), generator=torch.Generator().manual_seed(2))
    expected = ours(model, tokens)
    assert (hf_logits(out, tokens) - expected).abs().max() < TOLERANCE
    # the same weights without the RoPE reordering compute something else: the comparison above can fail
    unpermuted = transformers.LlamaForCausalLM(config).eval()
    state = to_llama_state_dict(model)
    for name in state:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            inverse = torch.argsort(rope_half_order(16))
            state[name] = state[name].view(4, 16, 64)[:, inverse].reshape(64, 64)
    unpermuted.load_state_dict(state)
    with torch.no_grad():
        assert (unpermuted(tokens).logits - expected).abs().max() > 10 * TOLERANCE


@pytest.mark.timeout(60)
def test_subspace_models_and_bad_targets_are_refused(tmp_path: Path) -> None:
    subspace = ModelConfig(d_model=64, n_layers=2, n_heads=4, max_seq_len=64, subspace_rank=16)
    with pytest.raises(NotLlamaError, match="subspace_rank = 16"):
        llama_config(subspace)
    with pytest.raises(NotLlamaError, match="subspace-constrained"):
        to_llama_state_dict(Transformer(subspace))
    with pytest.raises(ExportError, match="cannot be exported as a Hugging Face LLaMA"):
        export(tmp_path, tiny_config(model=subspace), Transformer(subspace))
    assert not (tmp_path / "hf").exists()  # refused before anything is written
    export_checkpoint(tmp_path / "model.pt", tmp_path / "sub.pt", format="pt")  # its own format still works

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"holds other files \(notes.txt\)"):
        export_target(tmp_path / "taken", ODD_MODEL, format="hf")
    with pytest.raises(ExportError, match="is a file: --format hf writes a folder"):
        export_target(tmp_path / "model.pt", ODD_MODEL, format="hf")
    with pytest.raises(ExportError, match="--tokenizer goes with --format hf"):
        export_target(tmp_path / "m.pt", ODD_MODEL, tokenizer=tmp_path / "tok.json")
    (tmp_path / "tok.json").write_text("{not json")
    with pytest.raises(ExportError, match="is not a tokenizer file"):
        export_target(tmp_path / "x", ODD_MODEL, format="hf", tokenizer=tmp_path / "tok.json")
    with pytest.raises(ExportError, match="cannot read tokenizer"):
        export_target(tmp_path / "x", ODD_MODEL, format="hf", tokenizer=tmp_path / "missing.json")


def bpe_tokenizer(path: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["def export(model): return model.state_dict()"] * 20, trainer)
    tokenizer.save(str(path))


@pytest.mark.timeout(60)
def test_the_tokenizer_goes_along_when_given_and_must_fit_the_vocabulary(tmp_path: Path) -> None:
    bpe_tokenizer(tmp_path / "tok.json", 290)
    model = Transformer(ODD_MODEL)
    out = export(
        tmp_path,
        tiny_config(model=ODD_MODEL),
        model,
        tokenizer=tmp_path / "tok.json",
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    loaded = transformers.AutoTokenizer.from_pretrained(out)
    ids = loaded("def export(model):")["input_ids"]
    from tokenizers import Tokenizer

    assert ids == Tokenizer.from_file(str(tmp_path / "tok.json")).encode("def export(model):").ids
    assert len(ids) < len("def export(model):")  # merges applied: a BPE, not bytes
    assert (hf_logits(out, torch.tensor([ids])) - ours(model, torch.tensor([ids]))).abs().max() < TOLERANCE

    export_checkpoint(tmp_path / "model.pt", out, format="hf")  # again without one: no stale tokenizer left behind
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]

    big = Tokenizer.from_file(str(tmp_path / "tok.json"))
    big.add_tokens([f"<extra{i}>" for i in range(300 - big.get_vocab_size() + 1)])  # one id past the model's 299
    big.save(str(tmp_path / "big.json"))
    with pytest.raises(ExportError, match="token ids up to 300, but the model's vocabulary has 300 entries"):
        export_target(tmp_path / "x", ODD_MODEL, format="hf", tokenizer=tmp_path / "big.json")

    # a model trained with a BPE tokenizer exports that tokenizer's file only (by its sha256, as peers check it)
    trained_with = tiny_config(
        model=ODD_MODEL, data={"tokenizer": "bpe", "tokenizer_sha256": file_sha256(tmp_path / "tok.json")}
    )
    save_checkpoint(tmp_path / "bpe.pt", trained_with, model)
    with pytest.raises(ExportError, match="trained with the tokenizer of sha256"):
        export_checkpoint(tmp_path / "bpe.pt", tmp_path / "other", format="hf", tokenizer=tmp_path / "big.json")
    export_checkpoint(tmp_path / "bpe.pt", tmp_path / "same", format="hf", tokenizer=tmp_path / "tok.json")


def refused(result: subprocess.CompletedProcess[str], says: str) -> None:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert says in lines[0], lines[0]


@pytest.mark.timeout(180)
def test_cli_exports_a_train_local_checkpoint(tmp_path: Path, child_processes: list) -> None:
    save_config(tiny_config(), tmp_path / "tiny.toml")
    run = tmp_path / "run"
    train_local = ["train-local", "--config", str(tmp_path / "tiny.toml"), "--data", DATA, "--steps", "3"]
    (trained_run,) = swarmloco([*train_local, "--log-every", "3", "--out", str(run)], children=child_processes)
    assert trained_run.returncode == 0, trained_run.stderr
    out = tmp_path / "hf"
    exported, neither, both, pt_tokenizer = swarmloco(
        ["export", "--checkpoint", str(run / "model.pt"), "--format", "hf", "-o", str(out)],
        ["export"],
        ["export", "--checkpoint", str(run / "model.pt"), "--initial-peers", "/ip4/127.0.0.1/tcp/1"],
        ["export", "--checkpoint", str(run / "model.pt"), "--tokenizer", str(tmp_path / "tiny.toml")],
        children=child_processes,
    )
    assert exported.returncode == 0, exported.stderr
    assert f"wrote {out}/ (config.json, model.safetensors)" in exported.stdout
    assert "no tokenizer written: the model reads UTF-8 bytes" in exported.stdout
    refused(neither, "nothing to export: give --initial-peers MADDR (a running swarm) or --checkpoint FILE")
    refused(both, "--initial-peers is for a running swarm, not --checkpoint: give one source")
    refused(pt_tokenizer, "--tokenizer goes with --format hf")

    from swarm.recovery.checkpoint import load_checkpoint

    _, model, _ = load_checkpoint(run / "model.pt")
    tokens = torch.tensor([list(b"def export(model):")])
    assert (hf_logits(out, tokens) - ours(model, tokens)).abs().max() < TOLERANCE


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_exports_a_running_swarm_as_a_hugging_face_folder(tmp_path: Path, child_processes: list) -> None:
    swarm = Swarm(tmp_path, tiny_config(stages=1, steps=5000), child_processes)
    swarm.spawn("stage1-a", PeerConfig(role="stage", stage=1))
    swarm.spawn("trainer-0", PeerConfig(role="trainer", steps=5000, data=[DATA]))
    swarm.wait("3 steps", lambda: any(r["step"] >= 3 for r in swarm.progress("trainer-0")), 120)
    out = tmp_path / "hf"
    (exported,) = swarmloco(
        ["export", *swarm.join, "--format", "hf", "-o", str(out)], children=child_processes, timeout=120
    )
    swarm.stop("trainer-0", "stage1-a")
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert "stage 1/1" in exported.stdout and f"wrote {out}/ (config.json, model.safetensors)" in exported.stdout

    from safetensors import safe_open

    with safe_open(out / "model.safetensors", "pt") as f:
        provenance = json.loads(f.metadata()["swarmloco"])
    assert provenance["exported_from"] == swarm.cfg.swarm_id
    assert provenance["stages"]["1"]["peer"] == swarm.ids["stage1-a"]
    config = transformers.AutoConfig.from_pretrained(out)
    assert (config.hidden_size, config.num_hidden_layers) == (64, 2)
    logits = hf_logits(out, torch.tensor([list(b"def ")]))
    assert logits.shape == (1, 4, 256) and torch.isfinite(logits).all()
