"""The Llama family's mixture-of-experts and Qwen3-style variants as Hugging Face directories.

* qk_norm (with or without experts): a Qwen3-MoE directory (`Qwen3MoeForCausalLM`; no experts:
  `Qwen3ForCausalLM`), with per-head q/k norms, any head_dim, and MoE layers every `every`-th
  layer (its `decoder_sparse_step`), the others dense with `intermediate_size`.
* experts without qk_norm: a Mixtral directory (`MixtralForCausalLM`): every layer MoE.

Both route as ours (softmax over all experts, top-k, weights renormalized: Qwen3-MoE's
norm_topk_prob, Mixtral's rule) and use the hub's per-expert tensor names, which transformers 5
merges into its 3-D expert weights on load. What neither holds is refused in one line: shared
experts, the sigmoid router (its balancing bias), a Mixtral with dense layers (every > 1).

Our tensors -> theirs (i: layer, e: expert, f: the expert's ffn):
    layers.i.attn.wqkv.weight            rows [q | k | v]  -> self_attn.{q,k,v}_proj.weight
    layers.i.attn.{q,k}_norm.weight                        -> self_attn.{q,k}_norm.weight
    layers.i.mlp.w_gate_up.weight        rows [gate | up]  -> mlp.{gate,up}_proj.weight  (dense layer)
    layers.i.mlp.router.weight                             -> mlp.gate.weight | block_sparse_moe.gate.weight
    layers.i.mlp.experts.w_gate_up[e]    rows [gate | up]  -> experts.e.{gate,up}_proj | experts.e.{w1,w3}
    layers.i.mlp.experts.w_down[e]                         -> experts.e.down_proj | experts.e.w2
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Mapping, Tuple

from ...core.errors import ConfigError
from .dims import GPTDims
from .hf_config import HF_DTYPE_NAMES, max_positions, rope_scaling_entry

if TYPE_CHECKING:
    import torch

QWEN3_MOE, QWEN3, MIXTRAL = "Qwen3MoeForCausalLM", "Qwen3ForCausalLM", "MixtralForCausalLM"


def uses_variant(d: GPTDims) -> bool:
    """Whether `d` needs this module's layouts instead of Llama's (models/llama/hf_export.py)."""
    return d.moe is not None or d.qk_norm


def architecture(d: GPTDims) -> str:
    """The HF class `d` exports as; ConfigError (CKPT_DIR) naming what none of them holds."""
    m = d.moe
    if m is not None and m.shared_experts:
        raise ConfigError("CKPT_DIR", f"the model has {m.shared_experts} shared expert(s) (model.moe.shared_experts), "
                          "which neither Qwen3-MoE nor Mixtral holds", "--format safetensors|torch")
    if m is not None and m.router != "softmax":
        raise ConfigError("CKPT_DIR", f"model.moe.router={m.router}: Qwen3-MoE and Mixtral route by softmax",
                          "--format safetensors|torch")
    if d.qk_norm:
        return QWEN3_MOE if m is not None else QWEN3
    if m.every != 1:
        raise ConfigError("CKPT_DIR", f"model.moe.every={m.every} leaves dense layers, which Mixtral has not "
                          "(Qwen3-MoE has: it needs model.qk_norm=true)", "--format safetensors|torch")
    return MIXTRAL


def hf_config(d: GPTDims, *, dtype: str = "float32", max_position_embeddings: int = 4096) -> Dict[str, Any]:
    arch = architecture(d)
    dtype = HF_DTYPE_NAMES.get(dtype, dtype)
    cfg: Dict[str, Any] = {
        "architectures": [arch], "hidden_size": d.dim, "num_hidden_layers": d.n_layers,
        "num_attention_heads": d.n_heads, "num_key_value_heads": d.n_kv_heads, "head_dim": d.head_dim,
        "vocab_size": d.vocab_size, "rms_norm_eps": d.norm_eps, "rope_theta": d.rope_theta,
        "tie_word_embeddings": d.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": 0.0, "max_position_embeddings": max_positions(d, max_position_embeddings),
        "use_cache": True, "torch_dtype": dtype, "dtype": dtype,
        **rope_scaling_entry(d),  # Llama-3 RoPE scaling: transformers' Qwen3 and Mixtral read it alike
    }
    m = d.moe
    if arch == MIXTRAL:
        cfg.update(model_type="mixtral", intermediate_size=m.ffn_dim, num_local_experts=m.experts,
                   num_experts_per_tok=m.top_k, router_jitter_noise=0.0, sliding_window=None,
                   router_aux_loss_coef=m.aux_loss_coef)
    elif arch == QWEN3:
        cfg.update(model_type="qwen3", intermediate_size=d.ffn_dim, use_sliding_window=False)
    else:
        cfg.update(model_type="qwen3_moe", intermediate_size=d.ffn_dim, moe_intermediate_size=m.ffn_dim,
                   num_experts=m.experts, num_experts_per_tok=m.top_k, norm_topk_prob=True,
                   decoder_sparse_step=m.every, mlp_only_layers=[], router_aux_loss_coef=m.aux_loss_coef,
                   use_sliding_window=False)
    return cfg


def tensor_table(d: GPTDims) -> Dict[str, Tuple[str, Callable]]:
    """{HF name: (our name, our tensor -> the HF tensor)}, in HF's order."""
    arch = architecture(d)
    q, kv, dense_f = d.q_dim, d.kv_dim, d.ffn_dim
    rows = lambda a, b: (lambda t: t[a:b])  # noqa: E731
    whole = lambda t: t  # noqa: E731
    out: Dict[str, Tuple[str, Callable]] = {"model.embed_tokens.weight": ("tok_emb.weight", whole)}
    for i in range(d.n_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        out[hf + "input_layernorm.weight"] = (ours + "attn_norm.weight", whole)
        for name, (a, b) in (("q", (0, q)), ("k", (q, q + kv)), ("v", (q + kv, q + 2 * kv))):
            out[hf + f"self_attn.{name}_proj.weight"] = (ours + "attn.wqkv.weight", rows(a, b))
        out[hf + "self_attn.o_proj.weight"] = (ours + "attn.wo.weight", whole)
        if d.qk_norm:
            out[hf + "self_attn.q_norm.weight"] = (ours + "attn.q_norm.weight", whole)
            out[hf + "self_attn.k_norm.weight"] = (ours + "attn.k_norm.weight", whole)
        out[hf + "post_attention_layernorm.weight"] = (ours + "mlp_norm.weight", whole)
        if not d.is_moe_layer(i):
            out[hf + "mlp.gate_proj.weight"] = (ours + "mlp.w_gate_up.weight", rows(0, dense_f))
            out[hf + "mlp.up_proj.weight"] = (ours + "mlp.w_gate_up.weight", rows(dense_f, 2 * dense_f))
            out[hf + "mlp.down_proj.weight"] = (ours + "mlp.w_down.weight", whole)
            continue
        f = d.moe.ffn_dim
        block = "block_sparse_moe." if arch == MIXTRAL else "mlp."
        names = ("w1", "w3", "w2") if arch == MIXTRAL else ("gate_proj", "up_proj", "down_proj")
        out[hf + block + "gate.weight"] = (ours + "mlp.router.weight", whole)
        for e in range(d.moe.experts):
            pre = f"{hf}{block}experts.{e}."
            out[pre + names[0] + ".weight"] = (ours + "mlp.experts.w_gate_up", lambda t, e=e: t[e, :f])
            out[pre + names[1] + ".weight"] = (ours + "mlp.experts.w_gate_up", lambda t, e=e: t[e, f:])
            out[pre + names[2] + ".weight"] = (ours + "mlp.experts.w_down", lambda t, e=e: t[e])
    out["model.norm.weight"] = ("norm.weight", whole)
    if not d.tie_embeddings:
        out["lm_head.weight"] = ("lm_head.weight", whole)
    return out


# Our state's entries that hold no weight of the HF model (recomputed or re-counted there).
NOT_EXPORTED = (".mlp.router.load", ".mlp.router.aux_sum", ".mlp.router.expert_bias")


def variant_tensors(state: Mapping[str, "torch.Tensor"], dims: GPTDims, out_dtype: "torch.dtype"):
    """(bytes per HF tensor in order, name -> that tensor) of a full (unsharded, unwrapped) MoE /
    qk_norm `gpt` state dict; ConfigError (CKPT_DIR) when it is not of `dims`."""
    import torch

    table = tensor_table(dims)
    state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and not k.endswith(NOT_EXPORTED)}
    ours = {src for src, _ in table.values()}
    extra, missing = sorted(set(state) - ours), sorted(ours - set(state))
    if extra or missing:
        raise ConfigError("CKPT_DIR", f"the weights are not a gpt of the configured dims: unknown {extra[:3]}, "
                          f"missing {missing[:3]}")

    def make(name: str) -> "torch.Tensor":
        src, pick = table[name]
        return pick(state[src]).to(out_dtype).clone()

    nbytes = {name: out_dtype.itemsize * pick(state[src]).numel() for name, (src, pick) in table.items()}
    return nbytes, make
