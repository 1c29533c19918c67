"""QLoRA (`model.peft.kind=qlora`): LoRA (models/lora.py) over a base whose adapted layers keep their
weights in 4-bit NF4 (torchao's NF4Tensor: 64-weight blocks, their scales quantized again in
blocks of 256, QLoRA's double quantization), about 0.52 bytes a weight instead of 2.

Those weights are replicated, not sharded: every rank holds them whole in NF4, FSDP2 leaves them
out (`fully_shard(ignored_params=...)`), and no step gathers or reduces them; FSDP2 shards the
adapters, their gradients and optimizer state as in a LoRA run. The base loads in the compute
dtype as for LoRA (`model.init_from` / `model.pretrained`), then `quantize_base` turns each
marked weight into NF4 once; a forward dequantizes it to the activations' dtype (torchao's
F.linear). Checkpoints hold the adapters only, so a resume loads and quantizes the base again
(deterministically: the same NF4 tensors). A weight whose size is not a multiple of 64 x 256 stays
in the compute dtype (and says so). Torch-free at import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List

from ..core.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

BLOCK, SCALER_BLOCK = 64, 256  # weights per NF4 scale; scales per block of their own (int8) quantization
QUANTUM = BLOCK * SCALER_BLOCK  # a weight's size must be a multiple of this
# Bytes a weight: 4 bits, an int8 scale per 64 weights, an fp32 factor per 256 of those scales.
NF4_BYTES = 0.5 + 1 / BLOCK + 4 / QUANTUM
INSTALL_HINT = "pip install 'mfsdp-launch[torchao]'"
_MARK = "_mfsdp_nf4"  # set on a base layer whose weight quantize_base turns into NF4 (on the module:
# a meta-device init makes new Parameter objects)


def enabled(m) -> bool:
    peft = getattr(m, "peft", None)
    return peft is not None and str(getattr(peft, "kind", "none")) == "qlora"


def quantizable(in_features: int, out_features: int) -> bool:
    return (in_features * out_features) % QUANTUM == 0


def nf4_params(adapted) -> int:
    """Base weights QLoRA keeps in NF4 of the adapted linear layers `adapted` ({name: (in, out)},
    lora.targeted): those whose size NF4 takes."""
    return sum(i * o for i, o in adapted.values() if quantizable(i, o))


def check_config(*, engine: str, fp8_recipe: str, compiled: bool) -> None:
    """What a QLoRA run needs beyond LoRA's checks (torch-free; validation, before spawning)."""
    import importlib.util

    key = "model.peft.kind"
    if engine != "fsdp2":
        raise ConfigError(key, f"qlora runs under engine=fsdp2 only: engine={engine} shards every parameter it "
                          "holds, and a 4-bit NF4 weight is none of its dtypes", "engine=fsdp2, or lora")
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(key, f"qlora keeps its base in torchao's NF4, and torchao is not installed ({INSTALL_HINT})")
    if fp8_recipe != "none":
        raise ConfigError("fp8.recipe", f"{fp8_recipe} with model.peft.kind=qlora: the adapted layers' base weights "
                          "are NF4, which no FP8 recipe converts", "none, or model.peft.kind=lora")
    if compiled:
        raise ConfigError("train.compile", "true with model.peft.kind=qlora was never run here (NF4 weights under "
                          "torch.compile)", "false, or model.peft.kind=lora")


def mark_base(layers: list) -> List[str]:
    """Mark the base weight of each adapted layer (peft's LoraLayer) whose size NF4 takes; returns
    the names of the base layers that stay in the compute dtype (their sizes)."""
    kept = []
    for layer in layers:
        base = layer.get_base_layer()
        if quantizable(base.in_features, base.out_features):
            setattr(base, _MARK, True)
        else:
            kept.append(f"{base.out_features}x{base.in_features}")
    return kept


def replicated(model: "nn.Module") -> set:
    """The parameters FSDP2 must leave whole on every rank (`fully_shard(ignored_params=...)`)."""
    return {m.weight for m in model.modules() if getattr(m, _MARK, False)}


def quantize_base(model: "nn.Module") -> str:
    """Each marked weight into NF4, in place (after the base is loaded); the start-up line."""
    import torch
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    done, before, after = 0, 0, 0
    for module in [m for m in model.modules() if getattr(m, _MARK, False)]:
        weight = module.weight
        if isinstance(weight.data, NF4Tensor):
            continue
        with torch.no_grad():
            nf4 = NF4Tensor.from_tensor(weight.data, BLOCK, SCALER_BLOCK)
        module.weight = torch.nn.Parameter(nf4, requires_grad=False)
        done += 1
        before += weight.numel() * weight.element_size()
        after += weight.numel() * NF4_BYTES
    return (f"; qlora: {done} base weights in NF4, {before / 2**20:,.1f} -> {after / 2**20:,.1f} MiB, "
            "whole on every rank")
