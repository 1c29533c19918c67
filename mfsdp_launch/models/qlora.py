"""QLoRA (`model.peft.kind=qlora`): LoRA (models/lora.py) over a base whose linear layers keep their
weights in 4-bit NF4 (torchao's NF4Tensor: 64-weight blocks, their scales quantized again in
blocks of 256, QLoRA's double quantization), about 0.52 bytes a weight instead of 2. Every linear
layer of the base but the output head (`lm_head`, as transformers' 4-bit loading keeps it),
adapted or not.

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


HEAD = "lm_head"  # the output head's name in gpt and in transformers' causal LMs: it stays as it is


def is_head(name: str) -> bool:
    return name == HEAD or name.endswith("." + HEAD)


def nf4_params(modules) -> int:
    """Base weights QLoRA keeps in NF4, of a model's lora.Modules table ({name: (in, out) | None})."""
    return sum(io[0] * io[1] for name, io in modules.items()
               if io is not None and not is_head(name) and quantizable(*io))


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
        raise ConfigError("fp8.recipe", f"{fp8_recipe} with model.peft.kind=qlora: the base's linear layers are NF4, "
                          "which no FP8 recipe converts", "none, or model.peft.kind=lora")
    if compiled:
        raise ConfigError("train.compile", "true with model.peft.kind=qlora was never run here (NF4 weights under "
                          "torch.compile)", "false, or model.peft.kind=lora")


def mark_base(model: "nn.Module") -> List[str]:
    """Mark the frozen linear layers of the adapted `model` (the adapters' base layers among them)
    that go to NF4; returns the sizes of those that stay in the compute dtype, the head aside."""
    from torch import nn

    outputs = getattr(model, "get_output_embeddings", lambda: None)()  # transformers' own head
    kept = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module.weight.requires_grad or is_head(name) or module is outputs:
            continue
        if quantizable(module.in_features, module.out_features):
            setattr(module, _MARK, True)
        else:
            kept.append(f"{module.out_features}x{module.in_features}")
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
