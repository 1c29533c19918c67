"""LoRA (`model.peft.kind=lora`): low-rank adapters from the `peft` library on a model's linear
layers, over a frozen pretrained base (docs/models.md, "LoRA").

An adapted layer computes `base(x) + (alpha / r) * B(A(dropout(x)))` with A [r, in] and B [out, r];
B starts at zero, so training starts exactly at the base model. peft injects the adapters in place
(no wrapper module), and renames the adapted layer's own weight: `layers.0.attn.wqkv.weight`
becomes `layers.0.attn.wqkv.base_layer.weight`, beside `...wqkv.lora_A.default.weight` and
`...wqkv.lora_B.default.weight`. `base_name` maps a live name back to the base's (None for an
adapter tensor), which is how the pretrained loader and the exports find the base's tensors.

Which layers: a module whose name is a `targets` entry or ends with "." + entry (peft's rule for
a list of `target_modules`), each entry matching at least one linear layer and nothing else
(`check_targets`, before spawning, on the family's list of modules). Torch-free at import: the
launcher checks configs with it; `apply_lora` imports peft.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Mapping, Optional, Sequence, Tuple

from ..core.errors import ConfigError

if TYPE_CHECKING:
    from torch import nn

ADAPTER = "default"  # peft's adapter name: the one adapter a run trains
ADAPTER_PARTS = ("lora_A", "lora_B")  # the parts of a name that mark an adapter tensor
INSTALL_HINT = "pip install 'mfsdp-launch[peft]'"

# {module name: (in_features, out_features)} for a linear layer, None for any other module.
Modules = Mapping[str, Optional[Tuple[int, int]]]


KINDS = ("lora", "qlora")  # model.peft.kind values that train adapters (qlora: over an NF4 base)


def enabled(m) -> bool:
    """Whether the `model` section `m` trains LoRA adapters (model.peft.kind=lora|qlora)."""
    peft = getattr(m, "peft", None)
    return peft is not None and str(getattr(peft, "kind", "none")) in KINDS


def scaling(p) -> float:
    return float(p.alpha) / int(p.r)


def matches(name: str, target: str) -> bool:
    """peft's rule for one entry of a target_modules list."""
    return name == target or name.endswith("." + target)


def targeted(modules: Modules, targets: Sequence[str]) -> Dict[str, Tuple[int, int]]:
    """The linear layers that get an adapter: {name: (in, out)}."""
    return {n: io for n, io in modules.items() if io is not None and any(matches(n, t) for t in targets)}


def linear_suffixes(modules: Modules) -> List[str]:
    """The last name parts of the linear layers (what a target usually names), sorted."""
    return sorted({n.rsplit(".", 1)[-1] for n, io in modules.items() if io is not None})


def check_targets(targets: Sequence[str], modules: Modules, family: str) -> None:
    """Every entry matches at least one linear layer of the model, and no other module."""
    key = "model.peft.targets"
    names = linear_suffixes(modules)
    if not targets:
        raise ConfigError(key, f"empty: name the linear layers of model={family} that get adapters",
                          "entries of " + ", ".join(names))
    for t in targets:
        t = str(t)
        if not t:
            raise ConfigError(key, "empty entry", ", ".join(names))
        hit = [n for n in modules if matches(n, t)]
        if not hit:
            raise ConfigError(key, f"{t!r} matches no module of model={family}; its linear layers are named",
                              ", ".join(names))
        other = [n for n in hit if modules[n] is None]
        if other:
            raise ConfigError(key, f"{t!r} matches {other[0]}, which is not a linear layer", ", ".join(names))


def check_config(m, fam, *, seq_len: int, tp: int, cuda_graph: bool, lora_families: Sequence[str]) -> None:
    """model.peft of the `model` section `m` of family `fam`: one ConfigError line for what cannot
    run (validation calls it before spawning)."""
    from ..core.schema import PeftConfig

    p = m.peft
    if not enabled(m):
        defaults = PeftConfig()
        for key in ("r", "alpha", "dropout", "targets"):
            value, default = getattr(p, key), getattr(defaults, key)
            if (list(value) if key == "targets" else value) != default:
                raise ConfigError(f"model.peft.{key}", f"is read by model.peft.kind=lora|qlora only, not {p.kind}",
                                  f"model.peft.kind=lora, or {default}")
        return
    if not fam.lora:
        raise ConfigError("model.peft.kind", f"{p.kind}: model={fam.name} cannot take LoRA adapters here",
                          "none, or model=" + "|".join(lora_families))
    import importlib.util

    if importlib.util.find_spec("peft") is None:  # (looked up, not imported: importing it takes seconds)
        raise ConfigError("model.peft.kind",
                          f"{p.kind} needs the peft library, which is not installed ({INSTALL_HINT})")
    if int(p.r) < 1:
        raise ConfigError("model.peft.r", f"must be >= 1, got {p.r}", "the adapters' rank, e.g. 8 or 16")
    if not float(p.alpha) > 0:
        raise ConfigError("model.peft.alpha", f"must be > 0, got {p.alpha}", "e.g. 2 * model.peft.r")
    if not 0 <= float(p.dropout) < 1:
        raise ConfigError("model.peft.dropout", f"must be in [0, 1), got {p.dropout}")
    if not fam.base_dir(m):
        value = getattr(m, fam.base_key.split(".")[-1])
        value = "null" if value is None else str(value).lower()
        raise ConfigError(fam.base_key, f"{value} gives model={fam.name} no "
                          f"pretrained base, and LoRA (model.peft.kind={p.kind}) trains adapters over one",
                          fam.base_hint)
    if list(m.freeze):
        raise ConfigError("model.freeze", "LoRA freezes every weight of the base already",
                          f"[] with model.peft.kind={p.kind}")
    if tp > 1:
        raise ConfigError("mesh.tp", f"{tp} with LoRA: adapters on tensor-parallel layers are not wired", "1")
    if cuda_graph:
        raise ConfigError("train.cuda_graph", "full_iteration with LoRA was never captured here", "none")
    check_targets(list(p.targets), fam.modules(m, seq_len), fam.name)


def adapter_params(modules: Modules, p) -> int:
    """Parameters the adapters of `p` (a model.peft section) add: r * (in + out) per layer."""
    return sum(int(p.r) * (i + o) for i, o in targeted(modules, list(p.targets)).values())


def is_adapter(name: str) -> bool:
    return any(part in ADAPTER_PARTS for part in name.split("."))


def base_name(name: str) -> Optional[str]:
    """The base model's name of a live (possibly adapted) model's tensor; None for an adapter's."""
    if is_adapter(name):
        return None
    return name.replace(".base_layer.", ".")


def adapter_key(name: str) -> Optional[Tuple[str, str]]:
    """(adapted module, "lora_A" | "lora_B") of an adapter tensor's name, else None:
    `layers.0.attn.wqkv.lora_A.default.weight` -> ("layers.0.attn.wqkv", "lora_A")."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in ADAPTER_PARTS:
            return ".".join(parts[:i]), part
    return None


def adapter_pairs(state: Mapping[str, object]) -> Dict[str, Tuple[object, object]]:
    """{adapted module: (A, B)} of a state dict holding adapter tensors."""
    parts: Dict[str, Dict[str, object]] = {}
    for name, t in state.items():
        found = adapter_key(name)
        if found is not None:
            parts.setdefault(found[0], {})[found[1]] = t
    return {m: (p["lora_A"], p["lora_B"]) for m, p in parts.items() if len(p) == 2}


# ------------------------------------------------------------------------------ torch side


def import_peft(key: str = "model.peft"):
    try:
        import peft
    except ImportError as exc:
        raise ConfigError(key, f"LoRA needs the peft library, which is not installed ({INSTALL_HINT})") from exc
    return peft


def module_table(model: "nn.Module") -> Dict[str, Optional[Tuple[int, int]]]:
    """The model's `Modules` table (names without the root's empty name)."""
    from torch import nn

    return {n: (m.in_features, m.out_features) if isinstance(m, nn.Linear) else None
            for n, m in model.named_modules() if n}


def apply_lora(model: "nn.Module", p) -> int:
    """Inject adapters for the `model.peft` section `p` into `model` in place (peft freezes
    every other parameter); returns how many layers got one. Built on the meta device too."""
    import functools

    peft = import_peft()
    config = peft.LoraConfig(r=int(p.r), lora_alpha=float(p.alpha), lora_dropout=float(p.dropout),
                             target_modules=[str(t) for t in p.targets], bias="none")
    peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    layers = adapter_layers(model)
    for layer in layers:
        # Megatron-FSDP's meta-device init calls reset_parameters() on every module owning a
        # parameter: nn.Linear's would draw B at random, and a LoRA starts at B = 0.
        b = layer.lora_B[ADAPTER]
        b.reset_parameters = functools.partial(_zero_weight, b)
    return len(layers)


def _zero_weight(module: "nn.Module") -> None:
    import torch

    with torch.no_grad():
        module.weight.zero_()


def adapter_layers(model: "nn.Module") -> list:
    from peft.tuners.lora import LoraLayer

    return [m for m in model.modules() if isinstance(m, LoraLayer)]


def reset_adapters(model: "nn.Module") -> None:
    """A Kaiming-uniform A and a zero B in every adapter (peft's init): after a family's
    init_weights, which re-draws every nn.Linear, the adapters' included."""
    import torch

    with torch.no_grad():
        for layer in adapter_layers(model):
            layer.lora_A[ADAPTER].reset_parameters()
            layer.lora_B[ADAPTER].reset_parameters()


def adapt(spec, model: "nn.Module", p) -> str:
    """Give the freshly built `model` the adapters of `p`, and make `spec.init_weights` (meta-device
    init) re-initialize them after the family's own init. Returns the start-up line."""
    layers = apply_lora(model, p)
    kept = []
    if str(p.kind) == "qlora":
        from . import qlora

        kept = qlora.mark_base(model)
    family_init = spec.init_weights

    def init_weights(m: "nn.Module") -> None:
        family_init(m)
        reset_adapters(m)

    spec.init_weights = init_weights
    trained = sum(t.numel() for t in model.parameters() if t.requires_grad)
    base = sum(t.numel() for t in model.parameters() if not t.requires_grad)
    line = (f"model.peft: {'QLoRA' if str(p.kind) == 'qlora' else 'LoRA'} r={p.r} alpha={p.alpha:g} on {layers} "
            f"layers ({', '.join(map(str, p.targets))}): {trained:,} adapter parameters train "
            f"({trained / max(base, 1):.2%} of the frozen base's {base:,})")
    if kept:
        line += (f"; {len(kept)} linear layers stay in the compute dtype (sizes not a multiple of 64 x 256: "
                 f"{kept[0]})")
    return line
