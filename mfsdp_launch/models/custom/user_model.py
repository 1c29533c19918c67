"""`model=custom`: the user's own `nn.Module`, from `model.target=pkg.module:function`.

* Resolution: `pkg.module:function` or `pkg.module.function` (the longest importable module
  prefix, the rest read as attributes) -> a callable; every failure is one ConfigError line.
* Units: `propose_unit_modules(model)` names the module classes worth sharding one by one (see its
  docstring); `resolve_unit_classes` turns `model.fsdp_unit_modules` into classes and refuses a
  class the model does not contain, listing the proposal.
* Batch contract (`model.loss`): `cross_entropy` calls `model(input_ids)` and expects logits
  [B, T, V] (a tensor, or an output with `.logits`, or a tuple whose first item is the logits);
  `model` calls `model(input_ids, labels)` and expects the scalar loss (a tensor, or `.loss`).
  `labels[b, t]` is the token after `input_ids[b, t]`: already shifted, do not shift again.
  `auto` picks `model` when `forward` has a `labels` parameter, else `cross_entropy`.
* Sizes: `model_stats(model, seq_len)` on a meta-device build counts parameters, matmul
  parameters and FLOPs per token (6N, plus attention when the model exposes its dims) without
  allocating a weight.
"""

from __future__ import annotations

import inspect
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence

from ...core.schema import ModelLoss
from ...core.errors import ConfigError
from ...core.names import import_object
from .. import losses
from ..llama.dims import lm_flops_per_token

if TYPE_CHECKING:
    import torch
    from torch import nn

LOSS_MODES = tuple(mode.value for mode in ModelLoss)


# ------------------------------------------------------------------------------- resolution


def resolve_target(spec: str, *, key: str = "model.target") -> Callable:
    """`model.target` -> the callable that builds the model."""
    obj = import_object(spec, key=key)
    if not callable(obj):
        raise ConfigError(key, f"{spec!r} is a {type(obj).__name__}, not callable")
    return obj


def build_user_model(spec: str, kwargs: Optional[Mapping[str, Any]] = None, *,
                     key: str = "model.target") -> "nn.Module":
    """Call the target with `model.kwargs` on the current default device; the result must be an
    nn.Module. Arguments the target does not take are one line under `model.kwargs`."""
    from torch import nn

    fn = resolve_target(spec, key=key)
    kwargs = dict(kwargs or {})
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as exc:
        raise ConfigError("model.kwargs", f"{spec}: {exc}") from exc
    except ValueError:  # no signature (a builtin): let the call decide
        pass
    model = fn(**kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(key, f"{spec} returned a {type(model).__name__}, not a torch.nn.Module")
    return model


# ------------------------------------------------------------------------------- FSDP units


def class_name(cls: type) -> str:
    """The dotted name `import_object` resolves back to the class."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_container(m: "nn.Module") -> bool:
    from torch import nn

    return type(m) in (nn.ModuleList, nn.ModuleDict, nn.Sequential, nn.ParameterList, nn.ParameterDict)


def propose_unit_modules(model: "nn.Module") -> List[str]:
    """Dotted names of the module classes to shard as FSDP units, largest first.

    A good unit repeats (>= 2 instances: one all-gather per instance, overlapped with the
    neighbour's compute) and holds parameters in submodules (a transformer block, not its Linear
    or norm). Containers (ModuleList, Sequential, ...) are never proposed, nor a class nested
    inside another proposed class (Block, not its Attention and MLP). A model that repeats only
    leaf modules gets those leaves.
    """
    counts: Counter = Counter()
    parents: Dict[type, set] = {}
    leaf: Dict[type, bool] = {}
    params: Dict[type, int] = {}
    for m in model.modules():
        if m is model or _is_container(m) or not any(True for _ in m.parameters()):
            continue
        cls = type(m)
        counts[cls] += 1
        params[cls] = params.get(cls, 0) + sum(p.numel() for p in m.parameters())
        leaf[cls] = not any(any(True for _ in c.parameters()) for c in m.children())
        for child in m.modules():
            if child is not m:
                parents.setdefault(type(child), set()).add(cls)
    repeated = [c for c, n in counts.items() if n >= 2]
    blocks = [c for c in repeated if not leaf[c]] or repeated
    top = [c for c in blocks if not (parents.get(c, set()) & set(blocks) - {c})]
    return [class_name(c) for c in sorted(top, key=lambda c: -params[c])]


def resolve_unit_classes(names: Iterable[str], model: Optional["nn.Module"] = None, *,
                         key: str = "model.fsdp_unit_modules") -> tuple:
    """Dotted class names -> classes. With `model`: each must occur in it, and an empty list is
    refused with the proposal; both one line under `key`."""
    from torch import nn

    names = [str(n) for n in names]
    if not names:
        if model is None:
            return ()
        proposal = propose_unit_modules(model)
        hint = f"the model repeats: {', '.join(proposal)}" if proposal else "the model repeats no module class"
        raise ConfigError(key, f"is empty; name the classes to shard one by one ({hint})")
    classes = []
    for name in names:
        try:
            cls = import_object(name, key=key)
        except ConfigError as exc:
            proposal = propose_unit_modules(model) if model is not None else []
            if not proposal:
                raise
            raise ConfigError(key, f"{exc.problem} (the model repeats: {', '.join(proposal)})",
                              exc.allowed) from None
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            raise ConfigError(key, f"{name!r} is not an nn.Module class")
        classes.append(cls)
    if model is not None:
        present = {type(m) for m in model.modules()}
        for name, cls in zip(names, classes):
            if not any(issubclass(p, cls) for p in present):
                proposal = propose_unit_modules(model)
                raise ConfigError(key, f"the model contains no {name}"
                                       + (f" (it repeats: {', '.join(proposal)})" if proposal else ""))
    return tuple(classes)


# ------------------------------------------------------------------------------------ loss


def resolve_loss_mode(model: "nn.Module", mode: str = "auto") -> str:
    """`model.loss` -> "cross_entropy" or "model" (auto: "model" iff forward takes `labels`)."""
    mode = str(mode)
    if mode not in LOSS_MODES:
        raise ConfigError("model.loss", f"unknown loss {mode!r}", LOSS_MODES)
    if mode != "auto":
        return mode
    try:
        takes_labels = "labels" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        takes_labels = False
    return "model" if takes_labels else "cross_entropy"


def check_forward_signature(model: "nn.Module", mode: str, target: str) -> None:
    """The batch contract's call (`forward(input_ids)`, or `forward(input_ids, labels)` for
    model.loss=model) must bind to the model's forward: refused in one line before spawning,
    not a TypeError on every rank. A forward without a signature (a builtin) is not checked."""
    try:
        sig = inspect.signature(model.forward)
    except (TypeError, ValueError):
        return
    args = ("input_ids", "labels") if mode == "model" else ("input_ids",)
    try:
        sig.bind(*args)
    except TypeError as exc:
        name = f"{type(model).__name__}.forward{sig}"
        call = f"forward({', '.join(args)})"
        if mode == "model":
            raise ConfigError("model.loss", f"model, but {name} cannot be called as {call}: {exc}",
                              "cross_entropy (forward(input_ids) returns logits), or a forward that takes "
                              "labels and returns the loss") from None
        raise ConfigError("model.target", f"{target}: {name} cannot be called as {call}: {exc}",
                          "a forward(input_ids) returning logits [B, T, vocab], or "
                          "model.loss=model with forward(input_ids, labels)") from None


def loss_fn(mode: str) -> Callable[["nn.Module", dict], "torch.Tensor"]:
    """The loss function of a resolved mode ("cross_entropy" or "model")."""
    if mode == "cross_entropy":
        return losses.cross_entropy_loss
    if mode == "model":
        return losses.model_loss
    raise ConfigError("model.loss", f"unknown loss {mode!r}", LOSS_MODES[1:])


# ----------------------------------------------------------------------------------- sizes


@dataclass(frozen=True)
class ModelStats:
    num_params: int  # distinct parameters (tied ones once)
    matmul_params: int  # weights used in a matmul per token, the output head included
    flops_per_token: float  # 6 * matmul_params (+ attention when dims are known)
    param_bytes: int  # at the build's dtypes
    largest_unit_params: int  # the most one all-gather materializes (root remainder counted)
    dims: Optional[Dict[str, Any]]  # {"dim", "n_layers", "vocab_size", "tie_embeddings"} or None


def build_on_meta(build: Callable[[], "nn.Module"]) -> "nn.Module":
    """`build()` under `torch.device("meta")`: shapes without storage."""
    import torch

    with torch.device("meta"):
        return build()


def model_dims(model: "nn.Module") -> Optional[Dict[str, Any]]:
    """Dims a model exposes: `model.dims` (dim, n_layers[, vocab_size, tie_embeddings]; an object
    or a dict) or an HF `model.config` (hidden_size, num_hidden_layers, ...). None otherwise."""
    dims = getattr(model, "dims", None)
    get = (lambda k: dims.get(k)) if isinstance(dims, Mapping) else (lambda k: getattr(dims, k, None))
    if dims is not None and get("dim") and get("n_layers"):
        return {"dim": int(get("dim")), "n_layers": int(get("n_layers")), "vocab_size": get("vocab_size"),
                "tie_embeddings": bool(get("tie_embeddings"))}
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "get_text_config"):
        cfg = cfg.get_text_config()
    if cfg is not None and getattr(cfg, "hidden_size", None) and getattr(cfg, "num_hidden_layers", None):
        return {"dim": int(cfg.hidden_size), "n_layers": int(cfg.num_hidden_layers),
                "vocab_size": getattr(cfg, "vocab_size", None),
                "tie_embeddings": bool(getattr(cfg, "tie_word_embeddings", False))}
    return None


def matmul_params(model: "nn.Module", dims: Optional[Dict[str, Any]] = None) -> int:
    """Weights with >= 2 dims, except embedding tables (lookups); an embedding table that is also
    the output head counts once: when another module shares it (HF's tied lm_head) or when the
    dims say tied (our gpt's F.linear on tok_emb.weight) and its rows are the vocabulary."""
    from torch import nn

    owners: Dict[int, List[nn.Module]] = {}
    distinct: Dict[int, nn.Parameter] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(m)
            distinct[id(p)] = p
    tied = bool(dims and dims.get("tie_embeddings"))
    vocab = dims.get("vocab_size") if dims else None
    total = 0
    for pid, p in distinct.items():
        if p.ndim < 2:
            continue
        if all(isinstance(m, nn.Embedding) for m in owners[pid]):
            if tied and vocab is not None and p.shape[0] == vocab:
                total += p.numel()
            continue
        total += p.numel()
    return total


def largest_unit_params(model: "nn.Module", unit_classes: Sequence[type] = ()) -> int:
    """Parameters of the largest FSDP unit; the root holds everything outside the units (an
    upper bound when units nest)."""
    classes = tuple(unit_classes)
    units = [m for m in model.modules() if m is not model and classes and isinstance(m, classes)]
    inside = {id(p) for u in units for p in u.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in inside)
    return max([root, *(sum(p.numel() for p in u.parameters()) for u in units)])


def model_stats(model: "nn.Module", seq_len: int, unit_classes: Sequence[type] = ()) -> ModelStats:
    """Sizes of a (meta-device) model; FLOPs get the attention term when `model_dims` finds dims."""
    dims = model_dims(model)
    params = list(model.parameters())  # distinct: nn.Module dedupes tied parameters
    n_matmul = matmul_params(model, dims)
    flops = lm_flops_per_token(n_matmul, dims["n_layers"], dims["dim"], seq_len) if dims else 6.0 * n_matmul
    return ModelStats(
        num_params=sum(p.numel() for p in params),
        matmul_params=n_matmul,
        flops_per_token=flops,
        param_bytes=sum(p.numel() * p.element_size() for p in params),
        largest_unit_params=largest_unit_params(model, unit_classes),
        dims=dims,
    )
