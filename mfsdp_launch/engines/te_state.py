"""TE's FP8 scaling state (delayed scaling): what Megatron-FSDP's `state_dict` drops. Saved under
"te_extra_state" as bytes per TE module (plain tensors through torch.save, loaded with
weights_only), so a delayed-scaling run resumes with its amax history."""

from __future__ import annotations

import io
from typing import Any, Dict

import torch

TE_EXTRA_STATE = "te_extra_state"


def _te_base_class():
    try:
        from transformer_engine.pytorch.module.base import TransformerEngineBaseModule
    except Exception:  # noqa: BLE001 - TE absent or half-installed: no TE modules to save
        return None
    return TransformerEngineBaseModule


def te_modules(module: torch.nn.Module):
    """(name, module) of every Transformer Engine module (TE's base class; none without TE)."""
    base = _te_base_class()
    if base is None:
        return []
    return [(n, m) for n, m in module.named_modules() if isinstance(m, base)]


def _delayed_state(meta: dict):
    fwd, bwd = meta.get("scaling_fwd"), meta.get("scaling_bwd")
    if all(hasattr(s, "amax_history") and hasattr(s, "scale") for s in (fwd, bwd)):
        return fwd, bwd
    return None


def te_extra_state(module: torch.nn.Module) -> Dict[str, bytes]:
    """{TE module name: bytes} holding each module's FP8 delayed-scaling history (b"" when it has
    none). The key set depends only on the model's structure, so a fresh model's template has the
    same keys as the checkpoint. Tensors go through torch.save, loaded back with weights_only."""
    out: Dict[str, bytes] = {}
    for name, m in te_modules(module):
        payload = b""
        meta = getattr(m, "fp8_meta", None) or {}
        states = _delayed_state(meta)
        if states is not None:
            fwd, bwd = states
            recipe = meta.get("recipe")
            fmt = getattr(getattr(recipe, "fp8_format", None), "name", "HYBRID")
            algo = getattr(recipe, "amax_compute_algo", "max")
            blob = {
                "scale_fwd": fwd.scale.detach().cpu(), "amax_history_fwd": fwd.amax_history.detach().cpu(),
                "scale_bwd": bwd.scale.detach().cpu(), "amax_history_bwd": bwd.amax_history.detach().cpu(),
                "num_gemms": int(meta.get("num_gemms", 1)),
                "fp8_format": str(fmt),
                "margin": int(getattr(recipe, "margin", 0)),
                "amax_compute_algo": algo if isinstance(algo, str) else "max",
                "amax_history_len": int(fwd.amax_history.shape[0]),
                "fp8_dpa": bool(getattr(recipe, "fp8_dpa", False)),
            }
            buf = io.BytesIO()
            torch.save(blob, buf)
            payload = buf.getvalue()
        out[name or "root"] = payload
    return out


def load_te_extra_state(module: torch.nn.Module, state: Dict[str, Any]) -> int:
    """Restore what `te_extra_state` saved; returns how many modules got FP8 history."""
    restored = 0
    for name, m in te_modules(module):
        payload = state.get(name or "root")
        if isinstance(payload, torch.Tensor):
            payload = payload.cpu().numpy().tobytes()
        if not payload:
            continue
        blob = torch.load(io.BytesIO(bytes(payload)), weights_only=True, map_location="cpu")
        meta = m.fp8_meta
        if _delayed_state(meta) is None:
            from transformer_engine.common.recipe import DelayedScaling, Format

            recipe = meta.get("recipe")
            if recipe is None or not recipe.delayed():
                recipe = DelayedScaling(fp8_format=Format[blob["fp8_format"]], margin=blob["margin"],
                                        amax_history_len=blob["amax_history_len"],
                                        amax_compute_algo=blob["amax_compute_algo"],
                                        fp8_dpa=bool(blob.get("fp8_dpa", False)))
            meta["recipe"] = recipe
            meta["num_gemms"] = blob["num_gemms"]
            m.init_fp8_meta_tensors(recipe)
        fwd, bwd = _delayed_state(meta)
        with torch.no_grad():
            for st, key in ((fwd, "fwd"), (bwd, "bwd")):
                _copy_overlap(st.scale, blob[f"scale_{key}"])
                _copy_overlap(st.amax_history, blob[f"amax_history_{key}"])
        restored += 1
    if restored and torch.cuda.is_available():
        torch.cuda.synchronize()
    return restored


def _copy_overlap(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape == src.shape:
        dst.copy_(src)
        return
    sl = tuple(slice(0, min(a, b)) for a, b in zip(dst.shape, src.shape))
    dst[sl].copy_(src[sl])
