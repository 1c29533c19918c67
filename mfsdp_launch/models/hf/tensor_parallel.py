"""Tensor parallelism with sequence parallelism for `model=hf` under FSDP2, from the architecture's
own plan: `config.base_model_tp_plan` (transformers' names of the column- and row-parallel layers
of each decoder layer), or ours for Llama, Mistral, Qwen2 and Qwen3 where the config has none.

What runs, per decoder layer (torch's DTensor parallel styles, torchtitan's Llama layout):
  * "colwise" Linears (q/k/v, gate/up) are split by output features, "rowwise" ones (o, down) by
    input features; each rank computes its heads and its slice of the MLP;
  * between them the residual stream holds T/tp tokens (sequence parallelism): the first layer
    scatters the embedding output over the sequence, each module holding colwise Linears
    (attention, MLP) all-gathers its input, each rowwise output is reduce-scattered, and the
    layer's norms run on the local tokens with replicated weights (their gradients reduced
    over tp by DTensor);
  * "replicated_with_grad_allreduce" modules (Qwen3's per-head q/k norms) keep whole weights and
    see this rank's heads; DTensor sums their gradients over tp;
  * the final norm's output is gathered before the head. Embedding and head stay whole on every
    tp rank (FSDP2 shards them over dp), so tied embeddings stay tied.
Parameter names do not change and DTensors keep their global shapes, so DCP checkpoints reshard
between tp degrees and the HF export writes whole tensors.

An architecture whose plan uses other styles (experts, packed projections, gathered outputs) or
whose layers hold other parameter-owning modules is refused in one line naming it (`tp_problem`,
asked on the meta-device build before anything is spawned).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional

if TYPE_CHECKING:
    from torch import nn

COLWISE, ROWWISE, GRAD_ALLREDUCE = "colwise", "rowwise", "replicated_with_grad_allreduce"
STYLES = (COLWISE, ROWWISE, GRAD_ALLREDUCE)

_LLAMA = {f"layers.*.self_attn.{p}": COLWISE for p in ("q_proj", "k_proj", "v_proj")}
_LLAMA.update({"layers.*.self_attn.o_proj": ROWWISE, "layers.*.mlp.gate_proj": COLWISE,
               "layers.*.mlp.up_proj": COLWISE, "layers.*.mlp.down_proj": ROWWISE})
_QWEN3 = dict(_LLAMA, **{"layers.*.self_attn.q_norm": GRAD_ALLREDUCE, "layers.*.self_attn.k_norm": GRAD_ALLREDUCE})
# Ours, for configs without base_model_tp_plan (older transformers); the same layout as theirs.
OUR_PLANS: Dict[str, Dict[str, str]] = {"llama": _LLAMA, "mistral": _LLAMA, "qwen2": _LLAMA, "qwen3": _QWEN3}
LAYER_PREFIX = "layers.*."


@dataclass
class LayerPlan:
    """One decoder layer's parts, by path inside the layer."""

    colwise: List[str] = field(default_factory=list)
    rowwise: List[str] = field(default_factory=list)
    grad_allreduce: List[str] = field(default_factory=list)
    gathered: List[str] = field(default_factory=list)  # modules holding colwise Linears: input all-gathered
    norms: List[str] = field(default_factory=list)  # the layer's own norms: on the local tokens


def architecture(model: "nn.Module") -> str:
    config = getattr(model, "config", None)
    return f"{type(model).__name__} (model_type {getattr(config, 'model_type', None)!r})"


def plan_of(config) -> Optional[Dict[str, str]]:
    """The architecture's plan: the config's own, else ours, else None."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return dict(getattr(text, "base_model_tp_plan", None) or {}) or OUR_PLANS.get(getattr(text, "model_type", None))


def _layers(model: "nn.Module"):
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    return base, list(layers) if layers is not None else []


def layer_plan(model: "nn.Module") -> LayerPlan:
    """The plan applied to this model's decoder layers; ValueError(problem) where it cannot be."""
    plan = plan_of(model.config)
    if not plan:
        raise ValueError("has no tensor-parallel plan (no config.base_model_tp_plan, and not one of "
                         f"{', '.join(sorted(OUR_PLANS))})")
    odd = sorted(f"{k}: {v}" for k, v in plan.items() if v not in STYLES or not k.startswith(LAYER_PREFIX))
    if odd:
        raise ValueError(f"has a tensor-parallel plan this launcher does not apply ({', '.join(odd[:3])})")
    base, layers = _layers(model)
    if not layers or not hasattr(base, "norm"):
        raise ValueError("has no base_model.layers and final norm to apply its plan to")
    lp = LayerPlan()
    for key, style in plan.items():
        path = key[len(LAYER_PREFIX):]
        {COLWISE: lp.colwise, ROWWISE: lp.rowwise, GRAD_ALLREDUCE: lp.grad_allreduce}[style].append(path)
    lp.gathered = sorted({p.rsplit(".", 1)[0] for p in lp.colwise if "." in p})
    if any("." not in p for p in lp.colwise) or not lp.gathered:
        raise ValueError("has colwise layers directly in its decoder layer; no attention/MLP module to gather for")
    _check_layer(layers[0], lp)
    return lp


def _check_layer(layer: "nn.Module", lp: LayerPlan) -> None:
    """Every parameter of a layer is in the plan's modules or in a norm (1-D weights) of the layer."""
    import torch.nn as nn

    holders = {p.split(".", 1)[0] for p in lp.colwise + lp.rowwise + lp.grad_allreduce}
    for name, child in layer.named_children():
        if name in holders or not any(True for _ in child.parameters()):
            continue
        if any(p.ndim != 1 for p in child.parameters()):
            raise ValueError(f"has {type(child).__name__} ({name}) in its decoder layers, outside its plan")
        lp.norms.append(name)
    for path in lp.colwise + lp.rowwise:
        try:
            planned = layer.get_submodule(path)
        except AttributeError:  # a plan written for dense layers, on a sparse (MoE) one: Qwen2-MoE's
            raise ValueError(f"plans {path}, which its decoder layers do not have") from None
        if not isinstance(planned, nn.Linear):
            raise ValueError(f"plans {path} as {'colwise' if path in lp.colwise else 'rowwise'}, which is not an nn.Linear")
    for gathered in lp.gathered:
        module = layer.get_submodule(gathered)
        for name, p in module.named_parameters():
            owner = f"{gathered}.{name.rsplit('.', 1)[0]}"
            if owner not in lp.colwise + lp.rowwise + lp.grad_allreduce:
                raise ValueError(f"has a parameter {gathered}.{name} outside its plan")


def tp_problem(model: "nn.Module") -> str:
    """'' when this (meta-device) model can run tensor-parallel, else why not (one clause)."""
    try:
        layer_plan(model)
    except ValueError as exc:
        return f"{architecture(model)} {exc}"
    return ""


def tp_dims(model: "nn.Module") -> Dict[str, int]:
    """The sizes tp must divide: attention and key/value heads, the MLP's hidden width."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return {"attention heads": int(text.num_attention_heads),
            "key/value heads": int(getattr(text, "num_key_value_heads", None) or text.num_attention_heads),
            "intermediate_size": int(getattr(text, "intermediate_size", 0) or 0)}


def _gather_output(module, inputs, output):
    from torch.distributed.tensor import Replicate

    return output.redistribute(output.device_mesh, [Replicate()]).to_local()


def _gathered(x, mesh):
    """This rank's tokens -> the whole sequence (the backward takes this rank's tokens of the
    gradient, which the colwise layers' input DTensors have already summed over tp)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor.from_local(x, mesh, [Shard(1)], run_check=False).redistribute(mesh, [Replicate()]).to_local()


def _gather_input(mesh):
    """A pre-hook all-gathering `hidden_states`, given as a keyword (HF attention) or first argument (MLP)."""

    def hook(module, args, kwargs):
        if "hidden_states" in kwargs:
            kwargs = dict(kwargs, hidden_states=_gathered(kwargs["hidden_states"], mesh))
        else:
            args = (_gathered(args[0], mesh), *args[1:])
        return args, kwargs

    return hook


def parallelize_hf(model: "nn.Module", tp_mesh) -> None:
    """Apply the architecture's TP + SP over `tp_mesh` (a 1-D DeviceMesh) to a built HF causal LM, in place."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    lp = layer_plan(model)
    base, layers = _layers(model)
    for i, layer in enumerate(layers):
        styles = {p: ColwiseParallel() for p in lp.colwise}
        styles.update({p: RowwiseParallel(output_layouts=Shard(1)) for p in lp.rowwise})
        # Per-head norms: whole weights, this rank's heads ([B, T, heads, head_dim]: dim 2).
        styles.update({p: SequenceParallel(sequence_dim=2, use_local_output=True) for p in lp.grad_allreduce})
        styles.update({p: SequenceParallel(use_local_output=True) for p in lp.norms})
        parallelize_module(layer, tp_mesh, styles)
        for p in lp.gathered:
            layer.get_submodule(p).register_forward_pre_hook(_gather_input(tp_mesh), with_kwargs=True)
        if i == 0:  # enter sequence parallelism: this rank's tokens of the embedding output
            parallelize_module(layer, tp_mesh, PrepareModuleInput(input_layouts=(Replicate(),),
                                                                  desired_input_layouts=(Shard(1),),
                                                                  use_local_output=True))
    parallelize_module(base.norm, tp_mesh, SequenceParallel())
    base.norm.register_forward_hook(_gather_output)  # leave it: the head sees every token
