"""LLaMA-style decoder (RMSNorm, RoPE, SwiGLU, causal SDPA), defined once as a plain nn.Module.

How the model is cut into pipeline stages lives in `swarm/model/stages.py`; this module knows nothing of stages,
peers or the network. With ``subspace_rank=k`` its residual stream is subspace-constrained (Protocol Models):
h = z @ U.T + T[tok] between any two blocks (docs/architecture.md, model/).

    >>> logits = Transformer(ModelConfig(preset="tiny"))(torch.randint(0, 256, (2, 32)))  # (B, T, vocab)
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from compress.config import check_choices, check_positive
from swarm.cli_fields import cli
from swarm.errors import ConfigError

Preset = Literal["tiny", "20m", "125m", "350m", "1b", "custom"]
# LLaMA-style shapes; the names count parameters with a ~32k-token vocabulary (the byte tokenizer's 256 gives fewer):
# tiny 1.6M, 20m 21M + embeddings, 125m 85M + 49M, 350m 302M + 66M, 1b 1.0B + 131M (``parameter_count`` is exact)
PRESETS: dict[Preset, dict[str, Any]] = {
    "tiny": {"d_model": 128, "n_layers": 8, "n_heads": 4, "max_seq_len": 128, "ffn_mult": 8 / 3},
    "20m": {"d_model": 384, "n_layers": 12, "n_heads": 6, "max_seq_len": 1024, "ffn_mult": 8 / 3},
    "125m": {"d_model": 768, "n_layers": 12, "n_heads": 12, "max_seq_len": 1024, "ffn_mult": 8 / 3},
    "350m": {"d_model": 1024, "n_layers": 24, "n_heads": 16, "max_seq_len": 1024, "ffn_mult": 8 / 3},
    "1b": {"d_model": 2048, "n_layers": 20, "n_heads": 16, "max_seq_len": 2048, "ffn_mult": 8 / 3},
}
# Each preset's inner-optimizer defaults: the ``[inner]`` fields a config that names the preset leaves out get these
# (``swarm/config.py``). The peak lr falls with size as in published recipes of comparable models: tiny's was tuned
# here; 20m: Pythia-70M (19M non-embedding parameters, like 20m's 21M); 125m: GPT-3 Small and Pythia-160M; 350m: GPT-3
# Medium and Pythia-410M; 1b: GPT-3 XL (1.3B) and Pythia-1.4B, the low end of the 2e-4 to 4e-4 (TinyLlama 1.1B) that
# 1B models train at, as a swarm's inner batch is far smaller than their 1-2M tokens. The recipes' warm-ups (GPT-3: 375M
# tokens; Pythia: 1% of the run; TinyLlama: 2,000 steps of 2M tokens) are longer than a whole run here: these grow from
# tiny's tuned 30 steps with the model. The other fields (beta2 0.95, weight decay 0.1, cosine to 10% of the peak, clip
# 1.0) are those recipes' at every size: the ``InnerOptimConfig`` defaults. The field comments there cite the same
# numbers (``swarmloco config show`` prints them; tests/test_config.py checks they agree). tiny's are the defaults
# themselves, so swarms of the default model keep their ids.
PRESET_INNER: dict[Preset, dict[str, Any]] = {
    "tiny": {"lr": 3e-3, "warmup_steps": 30},
    "20m": {"lr": 1e-3, "warmup_steps": 50},
    "125m": {"lr": 6e-4, "warmup_steps": 100},
    "350m": {"lr": 3e-4, "warmup_steps": 150},
    "1b": {"lr": 2e-4, "warmup_steps": 200},
}


@dataclass(kw_only=True)
class ModelConfig:
    # the shape's name: a preset fills the fields of PRESETS[preset] that a config leaves out, and the [inner] fields
    # of PRESET_INNER[preset] (its optimizer's defaults, from published recipes); afterwards it is derived from the
    # shape's fields (the preset they match, else "custom"), so it never lies about the shape
    preset: Preset = field(
        default="tiny",
        metadata=cli("Model shape: a preset fills the shape's fields and the inner optimizer's defaults."),
    )
    vocab_size: int = 256  # token ids: 256 for the byte tokenizer, a BPE tokenizer's own size otherwise
    d_model: int = 128  # width of the residual stream
    n_layers: int = 8  # transformer blocks, split among the middle stages
    n_heads: int = 4  # attention heads: each d_model / n_heads wide, an even width (RoPE)
    ffn_mult: float = 8 / 3  # SwiGLU hidden = round_up(ffn_mult * d_model, 16)
    max_seq_len: int = 128  # the longest sequence the model takes (its RoPE table)
    rope_theta: float = 10000.0  # RoPE base frequency
    norm_eps: float = 1e-5  # RMSNorm epsilon
    # k; 0 = unconstrained residual stream
    subspace_rank: int = field(
        default=0, metadata=cli("k of the subspace-constrained residual stream (0: unconstrained).", min=0)
    )
    subspace_seed: int = 1234  # seeds U and T; part of the swarm identity
    init_seed: int = 0  # seeds the initial weights: every replica of a stage starts alike

    def __post_init__(self) -> None:
        check_choices(self)
        self.preset = next(
            (name for name, shape in PRESETS.items() if all(getattr(self, k) == v for k, v in shape.items())), "custom"
        )
        check_positive(self, "vocab_size", "d_model", "n_layers", "n_heads", "max_seq_len")
        if self.d_model % self.n_heads:
            raise ConfigError("n_heads", f"must divide d_model={self.d_model}, got {self.n_heads}")
        if (self.d_model // self.n_heads) % 2:
            raise ConfigError("n_heads", "head dimension must be even for RoPE")
        if not 0 <= self.subspace_rank <= self.d_model:
            raise ConfigError("subspace_rank", f"must be in [0, d_model={self.d_model}], got {self.subspace_rank}")
        if self.ffn_mult <= 0:
            raise ConfigError("ffn_mult", f"must be positive, got {self.ffn_mult}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        return 16 * math.ceil(self.ffn_mult * self.d_model / 16)


def subspace_basis(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The seeded orthonormal basis U (d×k) and fixed token table T (vocab×d)."""
    g = torch.Generator().manual_seed(cfg.subspace_seed)
    q, _ = torch.linalg.qr(torch.randn(cfg.d_model, cfg.subspace_rank, generator=g, dtype=torch.float64))
    table = torch.randn(cfg.vocab_size, cfg.d_model, generator=g, dtype=torch.float64) * 0.02
    return q.float().contiguous(), table.float().contiguous()


class SubspaceLinear(nn.Module):
    """y = (x @ W.T) @ U.T with W of shape (k, in): the output lies in span(U) after any update."""

    basis: torch.Tensor  # a buffer

    def __init__(self, in_features: int, basis: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("basis", basis, persistent=False)  # (d, k), shared, never trained
        self.weight = nn.Parameter(torch.empty(basis.shape[1], in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.weight), self.basis)


def rope_cache(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float32), inv_freq)  # (T, hd/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, H, T, hd); rotate interleaved pairs (x0, x1) by the position's angle
    x0, x1 = x[..., 0::2], x[..., 1::2]
    t = x.shape[-2]
    c, s = cos[:t], sin[:t]
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, basis: torch.Tensor | None) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.qkv = linear(cfg.d_model, 3 * cfg.d_model)
        self.out = linear(cfg.d_model, cfg.d_model) if basis is None else SubspaceLinear(cfg.d_model, basis)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # 3×(B, H, T, hd)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, hd)
        out: torch.Tensor = self.out(y.transpose(1, 2).reshape(b, t, d))
        return out


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig, basis: torch.Tensor | None) -> None:
        super().__init__()
        self.gate_up = linear(cfg.d_model, 2 * cfg.ffn_hidden)
        self.down = linear(cfg.ffn_hidden, cfg.d_model) if basis is None else SubspaceLinear(cfg.ffn_hidden, basis)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        out: torch.Tensor = self.down(F.silu(gate) * up)
        return out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, basis: torch.Tensor | None) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg, basis)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg, basis)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), cos, sin)
        h = h + self.mlp(self.mlp_norm(h))
        return h


class Embedding(nn.Module):
    """Token embedding; in subspace mode T[tok] + U·e[tok] with only e (vocab×k) trained."""

    basis: torch.Tensor | None  # buffers
    table: torch.Tensor | None

    def __init__(self, cfg: ModelConfig, basis: torch.Tensor | None, table: torch.Tensor | None) -> None:
        super().__init__()
        width = cfg.d_model if basis is None else cfg.subspace_rank
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, width))
        self.register_buffer("basis", basis, persistent=False)
        self.register_buffer("table", table, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        e = F.embedding(tokens, self.weight)  # (B, T, d) or (B, T, k)
        if self.basis is None or self.table is None:  # (both or neither)
            return e
        return F.linear(e, self.basis) + F.embedding(tokens, self.table)


class Transformer(nn.Module):
    """Decoder-only LM: embed → blocks → norm → lm_head. Stages reuse these submodules by name.

    ``init=False`` leaves the weights unset (memory allocated, never touched): a stage (``build_stage``) draws only its
    own part with ``seeded_init``, as the whole model would.
    """

    rope_cos: torch.Tensor  # buffers
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, *, init: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        basis, table = subspace_basis(cfg) if cfg.subspace_rank else (None, None)
        self.embed = Embedding(cfg, basis, table)
        self.blocks = nn.ModuleList(Block(cfg, basis) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = linear(cfg.d_model, cfg.vocab_size)
        cos, sin = rope_cache(cfg)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        if init:
            self.reset_parameters()

    def reset_parameters(self) -> None:
        seeded_init(self.cfg, dict(self.named_parameters()))

    def run_blocks(self, h: torch.Tensor, layers: range | None = None) -> torch.Tensor:
        for i in layers if layers is not None else range(len(self.blocks)):
            h = self.blocks[i](h, self.rope_cos, self.rope_sin)
        return h

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # tokens: (B, T) int64 → logits (B, T, vocab)
        logits: torch.Tensor = self.lm_head(self.norm(self.run_blocks(self.embed(tokens))))
        return logits


def linear(in_features: int, out_features: int) -> nn.Linear:
    """A bias-free ``nn.Linear`` without its default (Kaiming) init, which ``seeded_init`` would overwrite anyway: at
    1B sizes that init alone took seconds per stage."""
    # what nn.utils.skip_init does (typed): built on the meta device, then given memory it leaves as it is
    return nn.Linear(in_features, out_features, bias=False, device="meta").to_empty(device=torch.get_default_device())


# values drawn from one seed: a parameter's chunks are drawn in parallel, the same bits on any thread count
INIT_CHUNK = 1 << 20


def init_std(cfg: ModelConfig, name: str) -> float:
    """The initial weights' standard deviation of the full model's parameter ``name`` (a matrix)."""
    if name.endswith(("attn.out.weight", "mlp.down.weight")):
        return 0.02 / math.sqrt(2 * cfg.n_layers)  # GPT-2 style scaled residual init
    return 0.02


def chunk_seed(cfg: ModelConfig, name: str, chunk: int) -> int:
    """The seed of chunk ``chunk`` of the full model's parameter ``name``: depends on nothing else, so a stage draws
    its own weights without drawing the others' first, and every replica draws the same."""
    digest = hashlib.sha256(f"{cfg.init_seed}/{name}/{chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@torch.no_grad()
def seeded_init(cfg: ModelConfig, params: Mapping[str, torch.Tensor], *, threads: int | None = None) -> None:
    """Set ``params`` (named as in the full model: ``blocks.{i}.…``) to the model's seeded initial weights, in place.

    Norm gains are 1; every matrix is N(0, ``init_std``²), drawn ``INIT_CHUNK`` values at a time, each chunk from its
    own generator seeded by (``cfg.init_seed``, name, chunk index): the same bits on every replica, whatever part of
    the model it builds, in whatever order and on however many threads (``threads``; default: torch's).
    """
    jobs = []
    for name, p in params.items():
        if p.ndim == 1:
            p.fill_(1.0)
            continue
        flat, std = p.detach().view(-1), init_std(cfg, name)  # detached: written in place on the pool's threads
        for chunk, start in enumerate(range(0, flat.numel(), INIT_CHUNK)):
            jobs.append((flat[start : start + INIT_CHUNK], std, chunk_seed(cfg, name, chunk)))

    def draw(job: tuple[torch.Tensor, float, int]) -> None:
        values, std, seed = job
        values.normal_(0.0, std, generator=torch.Generator().manual_seed(seed))

    workers = min(threads or torch.get_num_threads(), len(jobs))
    if workers <= 1:
        for job in jobs:
            draw(job)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="init") as pool:  # normal_ leaves the GIL
        list(pool.map(draw, jobs))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: torch.Tensor,
    new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
) -> torch.Tensor:
    """Sample ``new_tokens`` after ``prompt`` (T,) int64; returns the prompt plus the sample."""
    g = torch.Generator().manual_seed(seed)  # sampling stays on the CPU: the same text from the same seed on any device
    tokens, device = prompt.cpu(), model.lm_head.weight.device
    for _ in range(new_tokens):
        logits = model(tokens[-model.cfg.max_seq_len :][None].to(device))[0, -1].float().cpu()  # (vocab,)
        logits = logits / max(temperature, 1e-5)
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, -math.inf)
        tokens = torch.cat([tokens, torch.multinomial(logits.softmax(-1), 1, generator=g)])
    return tokens
