"""Our `gpt`/`te_gpt` parameter names <-> Hugging Face Llama names, as one table of row segments.

Every tensor of ours is the row-wise concatenation of row ranges of HF tensors:

    gpt     layers.i.attn.wqkv.weight        = [q_proj; k_proj; v_proj]
            layers.i.mlp.w_gate_up.weight    = [gate_proj; up_proj]          (chunk(2): silu(gate) * up)
    te_gpt  layers.i.self_attention.layernorm_qkv.weight
                                             = per KV group g: [q heads of g; k head g; v head g]
            layers.i.layernorm_mlp.fc1_weight = [gate_proj; up_proj]         (TE's swiglu gates the first half)

TE's TransformerLayer defaults to `qkv_weight_interleaved=True`: its MultiheadAttention views the
fused QKV output as [..., ng, (np/ng + 2), hn] and splits the second-last dim into (np/ng, 1, 1),
so the weight's rows run group by group, each group holding its np/ng query heads, then its key
head, then its value head; query head h belongs to group h // (np/ng), as in HF's GQA.

`sources(dims, model)` gives, for each of our names, the list of `Segment(hf_name, hf_row, rows)`
that fill its rows in order. Export (`state_to_hf`), the CPU round trip (`hf_to_state`) and the
sharded loader (`mfsdp_launch.models.hf_weights`, which reads only the segments a rank's rows intersect)
all read that one table. No torch at import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Mapping, NamedTuple, Tuple

from .dims import GPTDims

if TYPE_CHECKING:
    import torch

MODELS = ("gpt", "te_gpt")

HF_EMBED = "model.embed_tokens.weight"
HF_NORM = "model.norm.weight"
HF_HEAD = "lm_head.weight"

# Our per-layer names; "{i}" is the layer index.
LAYER_NAMES = {
    "gpt": {
        "attn_norm": "layers.{i}.attn_norm.weight",
        "qkv": "layers.{i}.attn.wqkv.weight",
        "o": "layers.{i}.attn.wo.weight",
        "mlp_norm": "layers.{i}.mlp_norm.weight",
        "gate_up": "layers.{i}.mlp.w_gate_up.weight",
        "down": "layers.{i}.mlp.w_down.weight",
    },
    "te_gpt": {
        "attn_norm": "layers.{i}.self_attention.layernorm_qkv.layer_norm_weight",
        "qkv": "layers.{i}.self_attention.layernorm_qkv.weight",
        "o": "layers.{i}.self_attention.proj.weight",
        "mlp_norm": "layers.{i}.layernorm_mlp.layer_norm_weight",
        "gate_up": "layers.{i}.layernorm_mlp.fc1_weight",
        "down": "layers.{i}.layernorm_mlp.fc2_weight",
    },
}

# HF per-layer names.
HF_LAYER = {
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight",
    "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight",
    "o": "model.layers.{i}.self_attn.o_proj.weight",
    "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
}

# State-dict entries that hold no weights (TE's FP8 metadata); export and load skip them.
IGNORED_SUFFIX = "_extra_state"


class Segment(NamedTuple):
    """`rows` rows of HF tensor `hf_name`, starting at its row `hf_row`."""

    hf_name: str
    hf_row: int
    rows: int


def is_ignored(name: str) -> bool:
    return name.endswith(IGNORED_SUFFIX)


def _check_model(model: str) -> None:
    if model not in MODELS:
        raise ValueError(f"HF Llama layout is defined for {', '.join(MODELS)}, not {model!r}")


def _merge(segments: List[Segment]) -> List[Segment]:
    """Join consecutive segments that continue the same HF rows (fewer, larger reads)."""
    out: List[Segment] = []
    for s in segments:
        if out and out[-1].hf_name == s.hf_name and out[-1].hf_row + out[-1].rows == s.hf_row:
            out[-1] = Segment(s.hf_name, out[-1].hf_row, out[-1].rows + s.rows)
        else:
            out.append(s)
    return out


def qkv_segments(dims: GPTDims, model: str, layer: int) -> List[Segment]:
    """Row segments of the fused QKV weight of `layer`."""
    q, k, v = (HF_LAYER[n].format(i=layer) for n in ("q", "k", "v"))
    hd = dims.head_dim
    if model == "gpt":
        return [Segment(q, 0, dims.n_heads * hd), Segment(k, 0, dims.kv_dim), Segment(v, 0, dims.kv_dim)]
    per_group = dims.n_heads // dims.n_kv_heads
    segments: List[Segment] = []
    for g in range(dims.n_kv_heads):
        segments += [Segment(q, (g * per_group + j) * hd, hd) for j in range(per_group)]
        segments += [Segment(k, g * hd, hd), Segment(v, g * hd, hd)]
    return _merge(segments)


def sources(dims: GPTDims, model: str) -> Dict[str, List[Segment]]:
    """{our name: its row segments}, in our state-dict order."""
    _check_model(model)
    names = LAYER_NAMES[model]
    out: Dict[str, List[Segment]] = {"tok_emb.weight": [Segment(HF_EMBED, 0, dims.vocab_size)]}
    for i in range(dims.n_layers):
        hf = {n: pattern.format(i=i) for n, pattern in HF_LAYER.items()}
        ours = {n: pattern.format(i=i) for n, pattern in names.items()}
        out[ours["attn_norm"]] = [Segment(hf["attn_norm"], 0, dims.dim)]
        out[ours["qkv"]] = qkv_segments(dims, model, i)
        out[ours["o"]] = [Segment(hf["o"], 0, dims.dim)]
        out[ours["mlp_norm"]] = [Segment(hf["mlp_norm"], 0, dims.dim)]
        out[ours["gate_up"]] = [Segment(hf["gate"], 0, dims.ffn_dim), Segment(hf["up"], 0, dims.ffn_dim)]
        out[ours["down"]] = [Segment(hf["down"], 0, dims.dim)]
    out["norm.weight"] = [Segment(HF_NORM, 0, dims.dim)]
    if not dims.tie_embeddings:
        out["lm_head.weight"] = [Segment(HF_HEAD, 0, dims.vocab_size)]
    return out


def hf_shapes(dims: GPTDims) -> Dict[str, Tuple[int, ...]]:
    """{HF name: shape} of the Llama checkpoint with `dims`, in HF's order (embed, layers, norm, head)."""
    d, hd = dims.dim, dims.head_dim
    per_layer = {
        "attn_norm": (d,), "q": (dims.n_heads * hd, d), "k": (dims.kv_dim, d), "v": (dims.kv_dim, d),
        "o": (d, dims.n_heads * hd), "mlp_norm": (d,), "gate": (dims.ffn_dim, d), "up": (dims.ffn_dim, d),
        "down": (d, dims.ffn_dim),
    }
    out: Dict[str, Tuple[int, ...]] = {HF_EMBED: (dims.vocab_size, d)}
    for i in range(dims.n_layers):
        for n, shape in per_layer.items():
            out[HF_LAYER[n].format(i=i)] = shape
    out[HF_NORM] = (d,)
    if not dims.tie_embeddings:
        out[HF_HEAD] = (dims.vocab_size, d)
    return out


def inverse(table: Mapping[str, List[Segment]]) -> Dict[str, List[Tuple[str, int, Segment]]]:
    """{HF name: [(our name, our first row, segment), ...]}: where each HF tensor's rows live."""
    out: Dict[str, List[Tuple[str, int, Segment]]] = {}
    for ours, segments in table.items():
        row = 0
        for seg in segments:
            out.setdefault(seg.hf_name, []).append((ours, row, seg))
            row += seg.rows
    return out


def te_qkv_row_order(n_heads: int, n_kv_heads: int, head_dim: int) -> List[int]:
    """For each row of te_gpt's fused QKV weight, the row of gpt's [q; k; v] weight it holds."""
    dims = GPTDims(dim=n_heads * head_dim, n_layers=1, n_heads=n_heads, n_kv_heads=n_kv_heads,
                   ffn_dim=1, vocab_size=1, tie_embeddings=True, norm_eps=1e-5, rope_theta=1e4)
    base = {s.hf_name: start for s, start in _starts(qkv_segments(dims, "gpt", 0))}
    order: List[int] = []
    for seg in qkv_segments(dims, "te_gpt", 0):
        order += range(base[seg.hf_name] + seg.hf_row, base[seg.hf_name] + seg.hf_row + seg.rows)
    return order


def _starts(segments: List[Segment]):
    row = 0
    for seg in segments:
        yield seg, row
        row += seg.rows


# ------------------------------------------------------------------------ full-tensor conversion


def unknown_keys(state: Mapping[str, "torch.Tensor"], table: Mapping[str, List[Segment]]) -> List[str]:
    return [k for k in state if k not in table and not is_ignored(k)]


def hf_tensor(hf_name: str, shape: Tuple[int, ...], state: Mapping[str, "torch.Tensor"],
              placed: List[Tuple[str, int, Segment]]) -> "torch.Tensor":
    """HF tensor `hf_name` assembled from our full tensors (one fresh tensor)."""
    import torch

    first = state[placed[0][0]]
    out = torch.empty(shape, dtype=first.dtype)
    for ours, row, seg in placed:
        out[seg.hf_row:seg.hf_row + seg.rows].copy_(state[ours][row:row + seg.rows])
    return out


def state_to_hf(state: Mapping[str, "torch.Tensor"], dims: GPTDims, model: str) -> Dict[str, "torch.Tensor"]:
    """Our full (unwrapped, unsharded) state dict -> HF Llama tensors. Refuses unknown keys."""
    table = sources(dims, model)
    extra = unknown_keys(state, table)
    missing = [k for k in table if k not in state]
    if extra or missing:
        raise ValueError(f"state does not match {model} with {dims}: unknown {extra[:4]}, missing {missing[:4]}")
    placed = inverse(table)
    return {name: hf_tensor(name, shape, state, placed[name]) for name, shape in hf_shapes(dims).items()}


def hf_to_state(hf: Mapping[str, "torch.Tensor"], dims: GPTDims, model: str) -> Dict[str, "torch.Tensor"]:
    """HF Llama tensors -> our full state dict (fresh tensors)."""
    import torch

    out = {}
    for ours, segments in sources(dims, model).items():
        out[ours] = torch.cat([hf[s.hf_name][s.hf_row:s.hf_row + s.rows] for s in segments], dim=0)
    return out
