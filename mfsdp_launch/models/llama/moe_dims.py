"""The mixture-of-experts part of the Llama family in pure Python: `model.moe.*` resolved against
the preset and checked, which layers are MoE, and the counts that the dry run, validation and the
FLOPs figure use (total parameters, the active ones a token passes through, expert-only ones).

A MoE layer replaces the block's SwiGLU MLP with a router (dim x experts), `experts` routed
SwiGLU experts of hidden size `ffn_dim` (each token goes to `top_k` of them) and, when
`shared_experts` > 0, one always-on SwiGLU of hidden size shared_experts * ffn_dim. Layer i is MoE
when (i + 1) % every == 0 (HF's `decoder_sparse_step`); the others keep the dense MLP of
model.ffn_dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

from ...core.errors import ConfigError, check_at_least

ROUTERS = ("softmax", "sigmoid")
DEFAULTS: Dict[str, Any] = dict(top_k=2, shared_experts=0, every=1, router="softmax", aux_loss_coef=1e-3,
                                z_loss_coef=0.0, bias_update_rate=1e-3, capacity_factor=None)
KEYS = ("experts", "top_k", "shared_experts", "ffn_dim", "every", "router", "aux_loss_coef", "z_loss_coef",
        "bias_update_rate", "capacity_factor")


@dataclass(frozen=True)
class MoEDims:
    experts: int
    top_k: int
    shared_experts: int
    ffn_dim: int
    every: int
    router: str
    aux_loss_coef: float
    z_loss_coef: float
    bias_update_rate: float
    capacity_factor: Optional[float]

    @property
    def shared_ffn_dim(self) -> int:
        return self.shared_experts * self.ffn_dim

    def is_moe_layer(self, i: int) -> bool:
        return (i + 1) % self.every == 0

    def moe_layers(self, n_layers: int) -> int:
        return sum(self.is_moe_layer(i) for i in range(n_layers))

    def expert_params(self, dim: int) -> int:
        """The routed experts' weights of one MoE layer."""
        return self.experts * 3 * dim * self.ffn_dim

    def layer_mlp_params(self, dim: int) -> int:
        """Router, routed experts and the shared expert of one MoE layer (norms not included)."""
        return dim * self.experts + self.expert_params(dim) + 3 * dim * self.shared_ffn_dim

    def active_mlp_params(self, dim: int) -> int:
        """The weights one token multiplies in a MoE layer: router, top_k experts, shared expert."""
        return dim * self.experts + (self.top_k * self.ffn_dim + self.shared_ffn_dim) * 3 * dim

    def shape(self) -> dict:
        return {"experts": self.experts, "ffn_dim": self.ffn_dim, "shared_experts": self.shared_experts,
                "every": self.every}

    def describe(self) -> str:
        shared = f" shared={self.shared_experts}" if self.shared_experts else ""
        every = f" every={self.every}" if self.every > 1 else ""
        cap = f" capacity={self.capacity_factor:g}" if self.capacity_factor else " dropless"
        return f"moe: experts={self.experts} top_k={self.top_k}{shared} ffn={self.ffn_dim}{every} " \
               f"router={self.router}{cap}"


def resolve_moe(moe_cfg: Any, preset: Dict[str, Any], dense_ffn: int) -> Optional[MoEDims]:
    """`model.moe.*` over the preset's `moe` entry; None for a dense model (ConfigError naming a
    key set on one). `dense_ffn` is the model's ffn_dim, the experts' default size."""
    # A typed section, or a plain mapping (a checkpoint manifest's config).
    get = moe_cfg.get if isinstance(moe_cfg, Mapping) else (lambda k: getattr(moe_cfg, k, None))
    given = {k: _plain(get(k)) for k in KEYS} if moe_cfg is not None else {}
    base = dict(preset.get("moe") or {})
    values = {k: (given.get(k) if given.get(k) is not None else base.get(k)) for k in KEYS}
    if not values["experts"]:
        stray = [k for k in KEYS if k != "experts" and given.get(k) is not None]
        if stray:
            raise ConfigError(f"model.moe.{stray[0]}", "is set on a dense model (model.moe.experts is 0 or unset)",
                              "model.moe.experts=N to make the MLPs mixtures of experts, or leave it unset")
        return None
    for key, default in DEFAULTS.items():
        if values[key] is None:
            values[key] = default
    if values["ffn_dim"] is None:
        values["ffn_dim"] = dense_ffn
    dims = MoEDims(experts=int(values["experts"]), top_k=int(values["top_k"]),
                   shared_experts=int(values["shared_experts"]), ffn_dim=int(values["ffn_dim"]),
                   every=int(values["every"]), router=str(values["router"]),
                   aux_loss_coef=float(values["aux_loss_coef"]), z_loss_coef=float(values["z_loss_coef"]),
                   bias_update_rate=float(values["bias_update_rate"]),
                   capacity_factor=None if values["capacity_factor"] is None else float(values["capacity_factor"]))
    check_moe(dims, given)
    return dims


def _plain(v):
    return v.value if hasattr(v, "value") else v


def check_moe(d: MoEDims, given: Dict[str, Any]) -> None:
    """Each rule names its key (one line, before anything is spawned)."""
    if d.experts < 2:
        raise ConfigError("model.moe.experts", f"must be >= 2 for a mixture, got {d.experts}", "N >= 2, or 0: dense")
    if not 1 <= d.top_k <= d.experts:
        raise ConfigError("model.moe.top_k", f"{d.top_k} with model.moe.experts={d.experts}",
                          f"1..{d.experts} (experts each token goes to)")
    check_at_least(d, "model.moe", ("shared_experts",), 0)
    check_at_least(d, "model.moe", ("ffn_dim", "every"), 1)
    if d.router not in ROUTERS:
        raise ConfigError("model.moe.router", f"unknown router {d.router!r}", list(ROUTERS))
    for key in ("aux_loss_coef", "z_loss_coef"):
        value = getattr(d, key)
        if not (value >= 0 and math.isfinite(value)):
            raise ConfigError(f"model.moe.{key}", f"must be >= 0, got {value}", "0 (off) or a small weight, e.g. 1e-3")
    if d.router == "sigmoid":
        if not d.bias_update_rate >= 0:
            raise ConfigError("model.moe.bias_update_rate", f"must be >= 0, got {d.bias_update_rate}",
                              "0 (no balancing bias) or a small step, e.g. 1e-3")
    elif given.get("bias_update_rate") is not None:
        raise ConfigError("model.moe.bias_update_rate", "is read by model.moe.router=sigmoid only, not softmax",
                          "model.moe.router=sigmoid, or leave it unset")
    if d.capacity_factor is not None and not d.capacity_factor > 0:
        raise ConfigError("model.moe.capacity_factor", f"must be > 0, got {d.capacity_factor}",
                          "e.g. 1.25, or null (dropless)")


def check_expert_split(ep: int, experts: int, *, model: str, source: str, dense_hint: str) -> None:
    """mesh.ep against a model's routed experts per layer (0: a dense model), for every family:
    `model` names it, `source` is where its expert count comes from, `dense_hint` what gives a
    dense one experts. ep dividing dp_shard x cp is mfsdp_launch/mesh.py's rule."""
    if ep == 1:
        return
    if not experts:
        raise ConfigError("mesh.ep", f"{ep} splits the experts of a mixture of experts, and {model} has none",
                          f"1, or {dense_hint}")
    if experts % ep:
        raise ConfigError("mesh.ep", f"{ep} does not divide {source}={experts}",
                          f"a divisor of {source} that divides mesh.dp_shard*mesh.cp")


def expert_capacity(tokens: int, d: MoEDims) -> Optional[int]:
    """Slots per expert for a micro-batch of `tokens` (None: dropless)."""
    if d.capacity_factor is None:
        return None
    return max(1, math.ceil(d.capacity_factor * tokens * d.top_k / d.experts))
