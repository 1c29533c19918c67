"""Family `custom`: the user's own `nn.Module`, built by `model.target=pkg.module:function` with
`model.kwargs` (docs/models.md, "Your own model"; the rules live in models/custom/user_model.py).

Everything the launcher asks before spawning (checks, parameter count, FLOPs, memory, vocab,
names) comes from one meta-device build in a short-lived process (models/probe.py), cached for the
run; the launcher never imports torch or the user's code.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import List

from ...core.errors import ConfigError
from .. import probe as P
from ..family import ModelContext, ModelSpec, find_module
from .config import CustomModelConfig
from ..measured import MeasuredFamily

PROBE = "mfsdp_launch.models.custom.family:probe_custom"


def kwargs_of(m) -> dict:
    kwargs = m.kwargs if m.kwargs is not None else {}
    if not isinstance(kwargs, Mapping):
        raise ConfigError("model.kwargs", f"must be a mapping of keyword arguments, got {kwargs!r}", "{name: value}")
    return P.model_dict(kwargs)


class CustomFamily(MeasuredFamily):
    name = "custom"
    section = CustomModelConfig

    def probe(self, m) -> dict:
        if not m.target:
            raise ConfigError("model.target", "model=custom needs the function that builds the model",
                              "pkg.module:function")
        kwargs_of(m)
        return P.probe(PROBE, m, crash_key="model.target")

    def check(self, m, ctx: ModelContext) -> List[str]:
        self.probe(m)
        if ctx.engine == "megatron_fsdp" and m.init_on_meta and m.init_fn:
            raise ConfigError("model.init_fn", "Megatron-FSDP's meta-device init calls each module's "
                              "reset_parameters(), not model.init_fn", "null, or model.init_on_meta=false")
        return []

    def averages_own_loss(self, m) -> bool:
        return self.probe(m)["loss"] == "model"

    def n_heads(self, m):
        return (self.probe(m)["dims"] or {}).get("n_heads")

    def shape(self, m) -> dict:
        p = self.probe(m)
        return {"params": p["num_params"], "param_shapes": p["param_digest"], "vocab_size": p["vocab_size"]}

    def describe(self, m, seq_len: int) -> str:
        p = self.probe(m)
        units = ", ".join(c.rsplit(".", 1)[-1] for c in p["unit_classes"])
        return (f"custom {m.target} ({p['unit_count']} units: {units}; loss={p['loss']}; vocab={p['vocab_size']}) "
                + super().describe(m, seq_len).split(" ", 1)[1])

    def spec(self, m, seq_len: int) -> ModelSpec:
        import torch

        from . import user_model as um
        from ...components.precision import torch_dtype
        from ..toys.modules import reset_module_parameters

        p, kwargs, dtype = self.probe(m), kwargs_of(m), torch_dtype(m.params_dtype)
        init_fn = um.resolve_target(m.init_fn, key="model.init_fn") if m.init_fn else None
        built = {}

        def build():
            model = um.build_user_model(m.target, kwargs)
            built["cls"] = type(model)
            if dtype is not None:
                model.to(dtype)
            if init_fn is not None and not any(t.is_meta for t in model.parameters()):
                with torch.no_grad():  # the same weights with and without init_on_meta
                    init_fn(model)
            return model

        def init_weights(model):
            inner = find_module(model, built["cls"])
            with torch.no_grad():
                init_fn(inner) if init_fn is not None else reset_module_parameters(inner)

        return ModelSpec(name=self.name, build=build, unit_modules=um.resolve_unit_classes(m.fsdp_unit_modules),
                         loss=um.loss_fn(p["loss"]), init_weights=init_weights, uses_tokens=True,
                         synthetic_batch=None, tokens_per_sample=seq_len, num_params=p["num_params"],
                         flops_per_token=self.flops_per_token(m, seq_len), vocab_size=p["vocab_size"])


# ------------------------------------------------------------------ the probe (imports torch)


def probe_custom(d: dict) -> dict:
    """Build `d["target"]` on the meta device and check it: units, init, vocab, the batch contract
    and the freeze globs. Returns models/probe.py's `measure` plus loss, vocab_size."""
    from ...core.globs import check_globs_match
    from . import user_model as um

    m = SimpleNamespace(**d)
    model = um.build_on_meta(lambda: um.build_user_model(m.target, m.kwargs or {}))
    units = um.resolve_unit_classes(m.fsdp_unit_modules, model)
    if m.init_fn:
        um.resolve_target(m.init_fn, key="model.init_fn")
    elif m.init_on_meta:
        _check_resettable(model)
    loss = um.resolve_loss_mode(model, m.loss)
    um.check_forward_signature(model, loss, m.target)
    vocab = _vocab(m, model)
    _check_contract(model, loss, vocab, m.loss)
    out = P.measure(model, units)
    if m.freeze:
        check_globs_match("model.freeze", m.freeze, out["param_names"], "parameter")
    out.update(loss=loss, vocab_size=vocab)
    return out


def _check_resettable(model) -> None:
    for name, mod in model.named_modules():
        owns = any(True for _ in mod.parameters(recurse=False))
        if owns and not (hasattr(mod, "reset_parameters") or hasattr(mod, "_reset_parameters")):
            raise ConfigError("model.init_on_meta", f"true, but {name or 'the root'} ({type(mod).__name__}) holds "
                              "parameters and has no reset_parameters(), so they would stay uninitialized",
                              "false, or model.init_fn=pkg.module:fn")


def _vocab(m, model) -> int:
    from .user_model import model_dims

    found = (model_dims(model) or {}).get("vocab_size") or P.first_embedding_rows(model)
    if m.vocab_size is not None:
        if found is not None and int(m.vocab_size) > int(found):
            raise ConfigError("model.vocab_size", f"{m.vocab_size} is larger than the model's vocabulary ({found})")
        return int(m.vocab_size)
    if found is None:
        raise ConfigError("model.vocab_size", f"cannot tell the vocabulary size of {m.target}'s model (no "
                          "nn.Embedding, no dims['vocab_size']); set it")
    return int(found)


def _check_contract(model, loss: str, vocab: int, asked) -> None:
    """A meta-device forward on a [1, 8] batch: the output must follow the batch contract. A model
    that cannot run on the meta device (data-dependent code) is not checked here."""
    import torch

    from ..losses import output_logits

    ids = torch.zeros((1, 8), dtype=torch.long, device="meta")
    try:
        out = model(ids, ids) if loss == "model" else output_logits(model(ids))
    except Exception:  # noqa: BLE001 - not runnable on meta: the worker will tell
        return
    how = f"model.loss={asked}" + (f" (resolved to {loss})" if str(asked) == "auto" else "")
    shape = tuple(out.shape) if hasattr(out, "shape") else type(out).__name__
    if loss == "model":
        value = out.loss if hasattr(out, "loss") else out
        if not hasattr(value, "ndim") or value.ndim != 0:
            raise ConfigError("model.loss", f"{how}: forward(input_ids, labels) returned {shape}, not the scalar loss",
                              "cross_entropy, or return the loss")
    elif not (hasattr(out, "ndim") and out.ndim == 3 and tuple(out.shape[:2]) == (1, 8) and out.shape[-1] >= vocab):
        raise ConfigError("model.loss", f"{how}: forward(input_ids [1, 8]) returned {shape}, not logits "
                          f"[1, 8, >= {vocab}]", "model, or return the logits")


FAMILY = CustomFamily()
