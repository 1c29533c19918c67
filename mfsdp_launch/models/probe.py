"""A model built on the meta device and measured, for the checks and sizes of `model=custom` and
`model=hf` before anything is spawned.

The launcher imports neither torch nor the user's code (which may open a CUDA context that would
stay on GPU 0 for the whole run), so `probe(...)` runs the family's probe function in a
short-lived `python -c` process, the pattern of `models/meta.py::meta_names_isolated`, and caches
the answer for the run: validation, the dry run and the checkpoint manifest ask several times.
A process that already has torch (a worker, a test) probes in-process.

The probe function (`"pkg.module:function"`, called with the model config as a plain dict)
returns a JSON-able dict, usually `measure(model, ...)` plus family fields; a ConfigError it
raises comes back as the same one line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import warnings
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Sequence

from ..core.errors import ConfigError
from ..core.names import exception_line, import_object

if TYPE_CHECKING:
    from torch import nn

PROBE_TIMEOUT_S = 300
_MARK = "MFSDP_PROBE "
_CACHE: Dict[str, dict] = {}


def model_dict(m) -> dict:
    """The `model` config section (OmegaConf node, dataclass or mapping) as plain JSON types."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(m, DictConfig):
        return OmegaConf.to_container(m, resolve=True, enum_to_str=True)
    if dataclasses.is_dataclass(m):
        return json.loads(json.dumps(dataclasses.asdict(m), default=str))
    return json.loads(json.dumps(dict(m), default=str))


def probe(fn: str, m, *, crash_key: str) -> dict:
    """`fn(model_dict)`'s answer for this model config, cached per process. A ConfigError raised
    by `fn` is re-raised; any other failure is one ConfigError line under `crash_key`."""
    spec = model_dict(m)
    key = fn + json.dumps(spec, sort_keys=True)
    if key not in _CACHE:
        _CACHE[key] = _run_here(fn, spec, crash_key) if "torch" in sys.modules else _run_isolated(fn, spec, crash_key)
    return _CACHE[key]


def _call(fn: str, spec: dict) -> dict:
    with warnings.catch_warnings():  # a model's construction warnings would break the one-line errors
        warnings.simplefilter("ignore")
        return import_object(fn, key="model")(spec)


def _run_here(fn: str, spec: dict, crash_key: str) -> dict:
    try:
        return _call(fn, spec)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's code failed while building
        raise ConfigError(crash_key, f"building the model failed ({exception_line(exc)})") from exc


_CHILD = """\
import json, sys
from mfsdp_launch.core.errors import ConfigError
from mfsdp_launch.core.names import exception_line
from mfsdp_launch.models.probe import _MARK, _call
try:
    out = {"ok": _call(sys.argv[1], json.loads(sys.argv[2]))}
except ConfigError as exc:
    out = {"error": [exc.key, exc.problem, exc.allowed]}
except BaseException as exc:
    out = {"crash": exception_line(exc)}
print("\\n" + _MARK + json.dumps(out), flush=True)  # on a line of its own, whatever the model printed
"""


def _run_isolated(fn: str, spec: dict, crash_key: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # nothing is downloaded
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD, fn, json.dumps(spec)], capture_output=True,
                              text=True, timeout=PROBE_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        raise ConfigError(crash_key, f"building the model on the meta device took over {PROBE_TIMEOUT_S} s") from None
    lines = [x for x in proc.stdout.splitlines() if x.startswith(_MARK)]
    if not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError(crash_key, f"building the model failed (exit {proc.returncode}: {tail})")
    out = json.loads(lines[-1][len(_MARK):])
    if "error" in out:
        raise ConfigError(*out["error"])
    if "crash" in out:
        raise ConfigError(crash_key, f"building the model failed ({out['crash']})")
    return out["ok"]




# ------------------------------------------------------------------------------- measuring


def param_digest(model: "nn.Module") -> str:
    """A digest of the parameter names and shapes: what decides a checkpoint's tensors."""
    text = ";".join(f"{n}:{list(p.shape)}" for n, p in model.named_parameters())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def activation_elements(model: "nn.Module", unit_classes: Sequence[type] = ()) -> Dict[str, int]:
    """Rough elements kept for backward per token (a lower bound, as for `gpt`): each Linear's
    input and output, each norm's input. `per_token`: everything; `per_token_ckpt`: with each
    unit recomputed in backward (its input stays, plus one unit's full set); `units`,
    `unit_elements` (per unit, the largest `unit_max`) and `width` let `activation_bytes` price
    checkpointing some of the units (model.activation_checkpointing=selective)."""
    from torch import nn

    from .activation_checkpoint import outermost_units

    def elements(root) -> int:
        total = 0
        for m in root.modules():
            if isinstance(m, nn.Linear):
                total += m.in_features + m.out_features
            elif not isinstance(m, nn.Embedding):
                own = list(m.parameters(recurse=False))
                if own and all(p.ndim == 1 for p in own) and not any(True for _ in m.children()):
                    total += own[0].numel()  # a norm: its input
        return total

    full = elements(model)
    units = outermost_units(model, unit_classes) if unit_classes else []
    if not units:
        return {"per_token": full, "per_token_ckpt": full, "units": 0, "unit_elements": 0, "unit_max": 0,
                "width": 0}
    per_unit = [elements(u) for u in units]
    width = _hidden_width(model)
    ckpt = full - sum(per_unit) + max(per_unit) + len(units) * width
    return {"per_token": full, "per_token_ckpt": min(full, ckpt), "units": len(units),
            "unit_elements": sum(per_unit) // len(units), "unit_max": max(per_unit), "width": width}


def _hidden_width(model: "nn.Module") -> int:
    from torch import nn

    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m.embedding_dim
        if isinstance(m, nn.Linear):
            return m.in_features
    return 0


def first_embedding_rows(model: "nn.Module") -> Optional[int]:
    from torch import nn

    return next((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), None)


def measure(model: "nn.Module", unit_classes: Sequence[type]) -> Dict[str, Any]:
    """Sizes and names of a (meta-device) model, as JSON types."""
    from ..components.muon import muon_parameters
    from .custom.user_model import class_name, largest_unit_params, matmul_params, model_dims

    dims = model_dims(model)
    muon_ids = muon_parameters(model)
    return {
        "num_params": sum(p.numel() for p in model.parameters()),
        "matmul_params": matmul_params(model, dims),
        "muon_params": sum(p.numel() for p in model.parameters() if id(p) in muon_ids),
        "dims": dims,
        "largest_unit_params": largest_unit_params(model, unit_classes),
        "activations": activation_elements(model, unit_classes),
        "param_digest": param_digest(model),
        "param_names": [n for n, _ in model.named_parameters()],
        "unit_classes": [class_name(c) for c in unit_classes],
        "unit_count": sum(1 for m in model.modules() if unit_classes and isinstance(m, tuple(unit_classes))
                          and m is not model),
    }


def activation_parts(p: Mapping[str, Any], micro_batch_size: int, seq_len: int, bytes_per_el: int,
                     vocab_size: Optional[int], *, mode: str = "none", every: int = 1,
                     loss_kernel: str = "torch", compiled: bool = False) -> Dict[str, int]:
    """The memory estimate's lines from a probe's per-token elements, split and priced as gpt's
    (models/llama/dims.py): {"activations": the units (model.activation_checkpointing `mode`,
    every `every`-th unit when selective), "logits": the head's output and the loss's buffers
    (`loss_bytes_per_logit`; `compiled`: train.compile's cross-entropy, which keeps the bf16 logits
    and no fp32 copy of them); under model.loss_kernel=chunked one chunk's loss instead."""
    from .activation_checkpoint import checkpointed_blocks
    from .llama.dims import loss_bytes_per_logit

    a = p["activations"]
    n = int(a.get("units", 0))
    k = len(checkpointed_blocks(n, mode, every)) if n else 0
    if k == 0:
        per_token = a["per_token"]
    elif k == n:
        per_token = a["per_token_ckpt"]
    else:  # k of n units keep only their input; a unit recomputes after the later ones were freed
        per_token = a["per_token"] - k * (a["unit_elements"] - a["width"])
    tokens = micro_batch_size * seq_len
    vocab = vocab_size or 0
    # The head's output is among the Linear outputs counted per token: the logits line prices it.
    activations = int(tokens * max(per_token - vocab, 0) * bytes_per_el)
    if loss_kernel == "chunked":  # the head's output never exists whole
        from .chunked_loss import chunk_loss_bytes

        width = int((p.get("dims") or {}).get("dim", 0) or a.get("width", 0))
        return {"activations": activations, "logits": int(chunk_loss_bytes(vocab, tokens, width))}
    per_logit = loss_bytes_per_logit(loss_kernel, compiled)
    if loss_kernel != "te_fused" and not compiled:
        # The plain loss's fp32 buffers, and beside them the model's bf16 logits, which it returns
        # and the loop holds (measured: hfac_llama1b_s8192_none_fsdp2); the compiled and the fused
        # loss's counts include them.
        per_logit += bytes_per_el
    return {"activations": activations, "logits": int(tokens * vocab * per_logit)}
