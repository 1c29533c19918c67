"""Hugging Face mixture-of-experts models under `model=hf`: what the probe reads off their experts
blocks (counts for FLOPs, MFU, the parameter line and the memory estimate), and which ones
mesh.ep splits.

An experts block is a module registered as `experts` in its parent (the sparse MoE block beside
its router, in every HF MoE architecture), and the text config names the routed experts per layer
(`num_experts`, `num_local_experts` or `n_routed_experts`) and how many a token goes to
(`num_experts_per_tok`). A token multiplies top_k / E of each block's weights; shared experts and
routers are ordinary modules, counted whole.

mesh.ep > 1 replaces the experts block's forward (models/hf/expert_parallel.py) and so must know
its math: the architectures in SPLITTABLE, whose transformers 5 blocks hold fused 3-D SwiGLU
weights `gate_up_proj` [E, 2 * f, dim] ([gate; up] rows) and `down_proj` [E, dim, f] and take
(hidden_states, top_k_index, top_k_weights) from the block's own router. Any other MoE is refused
under mesh.ep > 1 in one line naming it; at mesh.ep = 1 it trains as HF wrote it.

`model.pretrained=true`: transformers 5 builds those fused weights but saves (and the Hub holds)
one 2-D tensor per expert and projection, as transformers 4's modules held them;
`legacy_expert_sources` says which of them fill each fused weight (EXPERT_FILES), and
models/hf_weights.py reads each rank's experts from them.

Torch-free at import: `moe_facts` runs in the probe's process (models/probe.py).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Sequence, Tuple

if TYPE_CHECKING:
    from torch import nn

# The causal LMs whose experts blocks mesh.ep splits (models/hf/expert_parallel.py).
SPLITTABLE = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
TOP_K_KEY = "num_experts_per_tok"
EXPERTS_NAME = "experts"  # the block's child holding the routed experts
WEIGHTS = ("gate_up_proj", "down_proj")  # the fused SwiGLU weights the split forward runs
# How the files name the parts of a fused experts block: (the block's name in the files, the gate,
# up and down projections of expert e: `<layer>.<block>.experts.<e>.<proj>.weight`).
EXPERT_FILES = {"Qwen3MoeForCausalLM": ("mlp", "gate_proj", "up_proj", "down_proj"),
                "MixtralForCausalLM": ("block_sparse_moe", "w1", "w3", "w2")}


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def routing(config) -> Tuple[str, int, int]:
    """(the config key naming the routed experts, E, top_k); E = 0 when the config has none."""
    text = _text_config(config)
    for key in EXPERT_COUNT_KEYS:
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return key, value, int(getattr(text, TOP_K_KEY, 0) or 0)
    return "", 0, 0


def experts_blocks(model: "nn.Module") -> List["nn.Module"]:
    """The routed-experts modules of a built HF MoE (none for a dense model)."""
    _, experts, top_k = routing(model.config)
    if not experts or not top_k:
        return []
    out = []
    for parent in model.modules():
        child = getattr(parent, "_modules", {}).get(EXPERTS_NAME)
        if child is not None and any(True for _ in child.parameters()):
            out.append(child)
    return out


def split_problem(model: "nn.Module") -> str:
    """'' when mesh.ep can split this model's experts blocks, else why not (one clause naming it)."""
    from .tensor_parallel import architecture

    _, experts, _ = routing(model.config)
    name = type(model).__name__
    if name not in SPLITTABLE:
        return (f"{architecture(model)} has experts blocks that mesh.ep does not split (it splits "
                f"{', '.join(SPLITTABLE)})")
    act = getattr(_text_config(model.config), "hidden_act", "silu")
    if act != "silu":
        return f"{architecture(model)} has hidden_act={act!r}; the split experts run SwiGLU (silu)"
    for block in experts_blocks(model):
        shapes = [tuple(getattr(getattr(block, w, None), "shape", ())) for w in WEIGHTS]
        if (len(shapes[0]) != 3 or len(shapes[1]) != 3 or shapes[0][0] != experts or shapes[1][0] != experts
                or any(True for n, _ in block.named_parameters() if n not in WEIGHTS)):
            return (f"{architecture(model)}'s {type(block).__name__} does not hold exactly the fused 3-D "
                    f"{' and '.join(WEIGHTS)} of its {experts} experts")
    return ""


def moe_facts(model: "nn.Module", unit_classes: Sequence[type] = ()) -> Dict[str, Any]:
    """What the family counts of a (meta-device) HF MoE, as JSON types; {} for a dense model.
    experts, top_k: per MoE layer; expert_params: every block's routed weights; active_expert_params:
    the top_k / E of them a token uses; unit_expert_params: the routed weights of the largest FSDP
    unit (0 when the largest is the root); split_problem: models/hf/moe.py's `split_problem`;
    router_aux_loss_coef: the balancing loss's weight where the config asks transformers to add it
    (`output_router_logits`), else 0 (models/hf/router_loss.py)."""
    blocks = experts_blocks(model)
    if not blocks:
        return {}
    key, experts, top_k = routing(model.config)
    text = _text_config(model.config)
    asked = bool(getattr(text, "output_router_logits", False))
    coef = float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0) if asked else 0.0
    sizes = {id(b): sum(p.numel() for p in b.parameters()) for b in blocks}
    total = sum(sizes.values())
    return {"experts_key": key, "experts": experts, "top_k": top_k, "moe_layers": len(blocks),
            "expert_params": total, "active_expert_params": total * top_k // experts,
            "unit_expert_params": _unit_expert_params(model, unit_classes, blocks, sizes),
            "split_problem": split_problem(model), "router_aux_loss_coef": coef}


def _unit_expert_params(model, unit_classes, blocks, sizes) -> int:
    from ..custom.user_model import largest_unit_params

    classes = tuple(unit_classes)
    units = [m for m in model.modules() if m is not model and classes and isinstance(m, classes)]
    if not units:
        return 0
    largest = max(units, key=lambda u: sum(p.numel() for p in u.parameters()))
    if sum(p.numel() for p in largest.parameters()) < largest_unit_params(model, classes):
        return 0  # the root is the largest unit
    inside = {id(m) for m in largest.modules()}
    return sum(sizes[id(b)] for b in blocks if id(b) in inside)


def inactive_params(facts: Dict[str, Any]) -> int:
    """The routed-expert weights a token does not multiply (0 for a dense model)."""
    return int(facts.get("expert_params", 0)) - int(facts.get("active_expert_params", 0))


def legacy_expert_sources(hf_class: str, shapes: Mapping[str, Tuple[int, ...]]) -> Dict[str, Any]:
    """{model tensor name: hf_weights.Source} for the fused experts weights (and a router under
    another block name) that the files (`shapes`: {HF tensor name: shape}) hold per expert; {} for
    other architectures or files that hold the fused names. Named for both the files' block name
    and `mlp` (transformers 5's module name), since only the model's own names are looked up."""
    from ..hf_weights import Stacked
    from ..llama.hf_keys import Segment

    if hf_class not in EXPERT_FILES:
        return {}
    block, *projs = EXPERT_FILES[hf_class]
    gate, up, down = projs
    names = "|".join(map(re.escape, projs))
    pattern = re.compile(rf"^(.*)\.{re.escape(block)}\.experts\.(\d+)\.({names})\.weight$")
    layers: Dict[str, Dict[int, Dict[str, str]]] = {}
    for name in shapes:
        hit = pattern.match(name)
        if hit:
            layers.setdefault(hit.group(1), {}).setdefault(int(hit.group(2)), {})[hit.group(3)] = name
    out: Dict[str, Any] = {}
    for layer, experts in layers.items():
        if sorted(experts) != list(range(len(experts))) or any(len(e) != 3 for e in experts.values()):
            continue  # not a whole block: the load names what is missing

        def rows(e: int, proj: str) -> Segment:
            name = experts[e][proj]
            return Segment(name, 0, shapes[name][0])

        order = range(len(experts))
        fused = dict(zip(WEIGHTS, (Stacked(tuple((rows(e, gate), rows(e, up)) for e in order)),
                                   Stacked(tuple((rows(e, down),) for e in order)))))
        router = f"{layer}.{block}.gate.weight"
        for name in {block, "mlp"}:
            out.update({f"{layer}.{name}.experts.{w}": src for w, src in fused.items()})
            if router in shapes:
                out[f"{layer}.{name}.gate.weight"] = [Segment(router, 0, shapes[router][0])]
    return out
