"""The model as a Hugging Face LLaMA: its ``config.json`` fields and its weights under LLaMA's names.

``llama_config`` gives the config and ``to_llama_state_dict`` the weights, with the fused q/k/v and gate/up
matrices split and each head's q and k rows reordered for LLaMA's RoPE; a subspace-constrained model is
refused. Why the reordering is exact: docs/architecture.md, model/.

    >>> tensors = to_llama_state_dict(model)  # {"model.layers.0.self_attn.q_proj.weight": ..., ...}
"""

from __future__ import annotations

from typing import Any

import torch

from swarm.model.transformer import ModelConfig, Transformer


class NotLlamaError(ValueError):
    """The model has parts a LLaMA cannot express."""


def check_expressible(cfg: ModelConfig) -> None:
    if cfg.subspace_rank:
        raise NotLlamaError(
            f"this model is subspace-constrained (model.subspace_rank = {cfg.subspace_rank}): its fixed token table and "
            "basis projections have no LLaMA equivalent, so it cannot be exported as a Hugging Face LLaMA; "
            "export it with --format pt"
        )


def llama_config(cfg: ModelConfig) -> dict[str, Any]:
    """``config.json`` of the LLaMA that computes what ``Transformer(cfg)`` computes."""
    check_expressible(cfg)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.ffn_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # transformers ≥ 5 reads rope_parameters, 4.x reads rope_theta
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": None,  # the model was trained on plain streams: no special tokens
        "eos_token_id": None,
    }


def rope_half_order(head_dim: int) -> torch.Tensor:
    """Row order that turns a head's interleaved RoPE pairs (2i, 2i+1) into rotate_half's (i, i + hd/2)."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def to_rotate_half(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """A q or k projection (heads·hd, d) with each head's rows reordered evens-then-odds."""
    head_dim = weight.shape[0] // n_heads
    return weight.view(n_heads, head_dim, -1)[:, rope_half_order(head_dim)].reshape(weight.shape)


def to_llama_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's weights under ``LlamaForCausalLM``'s names, contiguous fp32 copies (safetensors needs both)."""
    cfg = model.cfg
    check_expressible(cfg)
    state = {name: t.detach().to("cpu", torch.float32) for name, t in model.state_dict().items()}
    out = {
        "model.embed_tokens.weight": state["embed.weight"],
        "model.norm.weight": state["norm.weight"],
        "lm_head.weight": state["lm_head.weight"],
    }
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        q, k, v = state[ours + "attn.qkv.weight"].chunk(3, dim=0)
        gate, up = state[ours + "mlp.gate_up.weight"].chunk(2, dim=0)
        out |= {
            theirs + "input_layernorm.weight": state[ours + "attn_norm.weight"],
            theirs + "self_attn.q_proj.weight": to_rotate_half(q, cfg.n_heads),
            theirs + "self_attn.k_proj.weight": to_rotate_half(k, cfg.n_heads),
            theirs + "self_attn.v_proj.weight": v,
            theirs + "self_attn.o_proj.weight": state[ours + "attn.out.weight"],
            theirs + "post_attention_layernorm.weight": state[ours + "mlp_norm.weight"],
            theirs + "mlp.gate_proj.weight": gate,
            theirs + "mlp.up_proj.weight": up,
            theirs + "mlp.down_proj.weight": state[ours + "mlp.down.weight"],
        }
    return {name: t.contiguous().clone() for name, t in out.items()}
