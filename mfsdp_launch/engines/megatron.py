"""NVIDIA Megatron-FSDP (`fully_shard_model` + `fully_shard_optimizer`). CUDA + NCCL only.

The argument mapping (config -> Megatron-FSDP arguments) is the pure function
`plan_megatron_fsdp`, unit-tested without CUDA. The engine class applies it and works around
what Megatron-FSDP 0.6.1 leaves to the caller (see shared notes):

* `fully_shard` would discard our param groups: we call `fully_shard_model` and
  `fully_shard_optimizer` separately.
* `fully_shard_optimizer` runs one synthetic `step()` on zero gradients to create the optimizer
  state, which advances Adam's step count and applies weight decay (upstream issue 5974). We run
  it with lr=0 and weight_decay=0, restore them, and reset every step counter to 0, so the first
  real update equals plain AdamW's.
* Gradient scaling: HFSDP's helper buffer, one-rank PreMulSum and the multiply by 1.0 on one
  rank are corrected after wrapping (engines/megatron_grad_scaling.py).
* engine.fuse_wgrad_accumulation: TE layers write their weight gradients into the engine's
  buffer, with Megatron-FSDP's overwrite flag corrected for unsharded buffers
  (engines/megatron_wgrad_fusion.py).
* There is no compute dtype: the model is cast to `precision.compute_dtype` before wrapping (TE
  FP8 primary weights are left alone).
* Gradient clipping: the global L2 norm over uneven gradient shards (some `None`) is summed over
  the groups the shards are disjoint in (`dist_index`, TE's tp group), weighted so that one
  all-reduce over every rank gives it (engines/base.py), then every shard is scaled.
* Checkpoints: `model.state_dict()` gives DTensors (uneven shards, DCP-ready) but drops TE's
  `_extra_state` (FP8 delayed-scaling history) and is unsupported with `no_shard`. We save the
  FP8 history ourselves under "te_extra_state" (plain tensors serialized to bytes, no pickle of
  code objects), and save `no_shard` state as plain replicated tensors, which DCP reshards to
  any world size and any strategy.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from ..core.errors import ConfigError
from ..components.optim import set_lr
from ..components.precision import torch_dtype
from .base import Engine, local_tensor, square_sum
from .megatron_grad_scaling import correct_grad_scaling
from .megatron_plan import MegatronPlan, plan_megatron_fsdp
from .megatron_wgrad_fusion import fuse_te_wgrad_accumulation
from .te_state import TE_EXTRA_STATE, load_te_extra_state, te_extra_state
from ..core.names import first_line


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The MegatronFSDP module under torch.compile's OptimizedModule."""
    while hasattr(model, "_orig_mod"):
        model = model._orig_mod
    return model


def import_megatron_fsdp():
    """megatron_fsdp, or a RuntimeError with one clear line (a half-installed TE makes its import
    raise RuntimeError rather than ImportError)."""
    try:
        import megatron_fsdp
    except Exception as exc:  # noqa: BLE001 - see docstring
        first = first_line(exc)
        raise RuntimeError(f"engine=megatron_fsdp: cannot import megatron_fsdp "
                           f"({type(exc).__name__}: {first}); a half-installed Transformer Engine "
                           "causes this too") from exc
    return megatron_fsdp


def _is_quantized(t) -> bool:
    """A TE QuantizedTensor (FP8 primary weight), found without importing TE."""
    t = local_tensor(t)
    return any(c.__name__ == "QuantizedTensor" for c in type(t).__mro__)


def _cast_model(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast floating params/buffers to `dtype`; TE FP8 primary weights keep their type."""
    if not any(_is_quantized(p) for p in model.parameters()):
        model.to(dtype=dtype)
        return
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_floating_point() and not _is_quantized(p) and p.dtype != dtype:
                p.data = p.data.to(dtype)
        for name, b in list(module.named_buffers(recurse=False)):
            if b is not None and b.is_floating_point() and b.dtype != dtype:
                module._buffers[name] = b.to(dtype)


class MegatronFSDPEngine(Engine):
    name = "megatron_fsdp"

    def __init__(self, **engine_args):
        super().__init__(**engine_args)
        self.plan: Optional[MegatronPlan] = None
        self._model = None
        self._te_tp_group = None

    # ------------------------------------------------------------------------------ wrap

    def make_plan(self, init_on_meta: bool) -> MegatronPlan:
        return plan_megatron_fsdp(self.dims, self.sharding_cfg, self.precision_cfg, self.engine_cfg,
                                  mesh_enabled=self.mesh is not None, init_on_meta=init_on_meta,
                                  cuda_graph=self.cuda_graph_mode)

    def shard(self, model, spec, *, init_on_meta: bool):
        mfsdp = import_megatron_fsdp()
        plan = self.plan = self.make_plan(init_on_meta)
        units = tuple(spec.unit_modules)
        if plan.zero_dp_strategy == "optim_grads_params" and not any(
                isinstance(m, units) for m in model.modules() if m is not model):
            raise ConfigError("model.fsdp_unit_modules", f"no module of {model.__class__.__name__} is an "
                              f"FSDP unit ({', '.join(c.__name__ for c in units) or 'none given'}); "
                              "ZeRO-3 needs at least one", "class names of the model's blocks")
        _cast_model(model, torch_dtype(plan.compute_dtype))
        if plan.init_model_with_meta_device:
            _materialize_shared_params(model, self.device)
        from ..models.llama.te_modules import tp_group_of

        self._te_tp_group = tp_group_of(model)
        policy = mfsdp.MixedPrecisionPolicy(
            main_params_dtype=torch_dtype(plan.main_params_dtype),
            main_grads_dtype=torch_dtype(plan.main_grads_dtype),
            grad_comm_dtype=torch_dtype(plan.grad_comm_dtype),
        )
        kwargs = dict(
            module=model,
            fsdp_unit_modules=list(units),
            zero_dp_strategy=plan.zero_dp_strategy,
            outer_dp_sharding_strategy=plan.outer_dp_sharding_strategy,
            init_model_with_meta_device=plan.init_model_with_meta_device,
            mixed_precision_policy=policy,
            sync_model_each_microbatch=plan.sync_model_each_microbatch,
            report_nan_in_param_grad=plan.report_nan_in_param_grad,
            keep_fp8_transpose_cache=plan.keep_fp8_transpose_cache,
            use_decoupled_grad=plan.use_decoupled_grad,
            cuda_graph_mode=plan.cuda_graph_mode,
            nccl_ub=plan.nccl_ub,
            fsdp_double_buffer=plan.fsdp_double_buffer,
        )
        if plan.use_mesh:
            kwargs.update(
                device_mesh=self.mesh,
                dp_shard_dim=plan.dp_shard_dim,
                dp_outer_dim=plan.dp_outer_dim,
                tp_dim=plan.tp_dim,
                hybrid_fsdp_group=(self.mesh[plan.hybrid_fsdp_group_dim].get_group()
                                   if plan.hybrid_fsdp_group_dim else None),
            )
        from .megatron_experts import expert_kwargs

        kwargs.update(expert_kwargs(model, self.mesh, self.dims, plan))  # a mixture of experts: its mesh
        wrapped = mfsdp.fully_shard_model(**kwargs)
        correct_grad_scaling(wrapped)
        if plan.fuse_wgrad_accumulation:
            fuse_te_wgrad_accumulation(model)
        self._model = wrapped
        return wrapped

    def wrap_optimizer(self, model, optimizer):
        mfsdp = import_megatron_fsdp()
        if self.cuda_graph_mode:
            make_capturable(optimizer, self.device)
        saved = []
        for group in optimizer.param_groups:
            saved.append((float(group["lr"]), group.get("weight_decay")))
            set_lr(group, 0.0)
            if "weight_decay" in group:
                group["weight_decay"] = 0.0
        try:
            # Synthetic step on zero grads (0.6.1): with lr=0 and weight_decay=0 it changes nothing.
            optimizer = mfsdp.fully_shard_optimizer(optimizer)
        finally:
            for group, (lr, wd) in zip(optimizer.param_groups, saved):
                set_lr(group, lr)
                if wd is not None:
                    group["weight_decay"] = wd
        reset_step_counters(optimizer)
        return optimizer

    # ------------------------------------------------------------------------------ train loop

    def set_grad_sync(self, model, sync: bool) -> None:
        m = unwrap(model)
        # Only on a change: Megatron-FSDP logs a warning on every set_model_auto_sync(True) call
        # under no_shard/optim/HSDP, and the loop calls this before every microbatch.
        if getattr(m, "model_auto_sync", None) != bool(sync):
            m.set_model_auto_sync(bool(sync))

    def grad_norm_group(self):
        m = self._model
        if m is None or self.plan is None or self.plan.grad_norm_group == "none":
            return None
        index = m.dist_index
        group = index.get_dp_group() if self.plan.grad_norm_group == "hybrid" else index.get_fsdp_group()
        if group is None or dist.get_world_size(group) == 1:
            return None
        return group

    def _grad_attr(self) -> str:
        return "decoupled_grad" if self.plan is not None and self.plan.use_decoupled_grad else "grad"

    def _grads(self, model, tp_sharded: Optional[bool] = None) -> List[torch.Tensor]:
        """Local gradient shards; `tp_sharded` picks TE's tensor-parallel shards (True) or the
        parameters replicated over tp (False)."""
        from ..models.llama.te_parallel import is_tp_sharded

        out = []
        for p in unwrap(model).parameters():
            g = getattr(p, self._grad_attr(), None)
            if g is None or (tp_sharded is not None and is_tp_sharded(p) != tp_sharded):
                continue
            g = local_tensor(g)
            if g.numel():
                out.append(g)
        return out

    def tp_group(self):
        """The tp group of a model with TE tensor-parallel layers (models/llama/te_parallel.py), else None
        (the seed's toys replicate over tp)."""
        return self._te_tp_group

    def local_grad_square(self, model):
        """This rank's square sum over uneven shards (None where a shard is empty), and its shards."""
        m = unwrap(model)
        if not getattr(m, "model_auto_sync", True):
            raise RuntimeError("clip_grad_norm before the gradients were synchronized: call "
                               "set_grad_sync(model, True) before the last microbatch's backward")
        tp_group = self.tp_group()
        if tp_group is None:
            grads = self._grads(m)
            return square_sum(grads, self.device), grads
        from ..models.llama.te_parallel import sync_sequence_parallel_grads

        # Norm weights under sequence parallelism saw 1/tp of the tokens: sum them first.
        sync_sequence_parallel_grads(m.parameters(), tp_group, self._grad_attr())
        # TP shards are disjoint over tp; replicated parameters are counted once (1/tp per rank).
        sq = square_sum(self._grads(m, tp_sharded=True), self.device) + \
            square_sum(self._grads(m, tp_sharded=False), self.device) / self.dims.tp
        return sq, self._grads(m)

    def norm_groups(self):
        return [g for g in (self.grad_norm_group(), self.tp_group()) if g is not None]

    # ------------------------------------------------------------------------------ checkpoints

    def _checkpoint_format(self) -> str:
        return self.plan.checkpoint_format if self.plan is not None else "dtensor"

    def state_dict(self, model, optimizer, *, glu_tp1_chunks: bool = True) -> Dict[str, Any]:
        """{"model", "optimizer", ["te_extra_state"]} for DCP. Collective: every rank, same order.
        `glu_tp1_chunks=False` keeps Megatron-FSDP's one chunk per rank (for gathering, not DCP)."""
        m = unwrap(model)
        msd = {k: v for k, v in m.state_dict().items() if not k.endswith("_extra_state")}
        replicated = self._checkpoint_format() == "replicated"
        if replicated:
            msd = {k: _to_plain(v) for k, v in msd.items()}
        out: Dict[str, Any] = {"model": msd}
        if optimizer is not None:
            osd = optimizer.state_dict()
            if replicated:
                osd = dict(osd)
                osd["state"] = {i: {k: _to_plain(v) for k, v in s.items()} for i, s in osd["state"].items()}
            out["optimizer"] = osd
        if self._te_tp_group is not None and not replicated and glu_tp1_chunks:
            from .glu_layout import canonicalize_state

            # TE's fused SwiGLU fc1 is saved in the tp=1 row order, so DCP reshards it across tp.
            names = {}
            for name, p in m.named_parameters():
                names[id(p)] = names[id(getattr(p, "orig_param", p))] = name
            canonicalize_state(msd, optimizer, names, out.get("optimizer"), self.dims.tp)
        te_state = te_extra_state(getattr(m, "module", m))
        if te_state:
            out[TE_EXTRA_STATE] = te_state
        return out

    def load_state_dict(self, model, optimizer, state: Dict[str, Any], *, strict: bool = True) -> None:
        m = unwrap(model)
        if state.get(TE_EXTRA_STATE):
            # First: loading the weights re-quantizes FP8 primary weights with these scales.
            load_te_extra_state(getattr(m, "module", m), state[TE_EXTRA_STATE])
        m._replace_param_with_distributed_if_needed()
        msd = state["model"]
        if self._checkpoint_format() == "replicated":
            live = m.state_dict()
            msd = {k: _like(v, live.get(k)) for k, v in msd.items()}
        # strict=False: TE's _extra_state keys are handled above. Megatron-FSDP's post-load hook
        # copies the main weights into the compute weights.
        result = m.load_state_dict(msd, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing and strict:
            raise RuntimeError(f"the loaded state lacks model keys {missing[:4]}"
                               + (f" (+{len(missing) - 4} more)" if len(missing) > 4 else ""))
        if optimizer is not None and "optimizer" in state:
            osd = state["optimizer"]
            if self._checkpoint_format() == "replicated":
                live = optimizer.state_dict()["state"]
                osd = dict(osd)
                osd["state"] = {i: {k: _like(v, live.get(i, {}).get(k)) for k, v in s.items()}
                                for i, s in osd["state"].items()}
            optimizer.load_state_dict(osd)
            match_capturable(optimizer, self.device)

    def full_model_state_dict(self, model) -> Dict[str, torch.Tensor]:
        """Unsharded weights, prefixes stripped (collective; handles uneven shards)."""
        from torch.distributed.tensor import DTensor

        from .base import strip_prefixes
        from .glu_layout import GLU_SUFFIXES, glu_to_tp1

        sd = self.state_dict(model, None, glu_tp1_chunks=False)["model"]
        out = {}
        for k in sorted(sd):
            v = sd[k]
            if isinstance(v, DTensor):
                v = full_tensor(v)
                if self._te_tp_group is not None and k.endswith(GLU_SUFFIXES):
                    v = glu_to_tp1(v, self.dims.tp)  # tp-concatenated [gate_r | up_r] -> [gate | up]
            if isinstance(v, torch.Tensor):
                out[strip_prefixes(k)] = v.detach().cpu()
        return out


# ---------------------------------------------------------------------------------- helpers


def _materialize_shared_params(model: torch.nn.Module, device) -> None:
    """Materialize (and initialize) each meta parameter that several modules hold, before
    Megatron-FSDP's meta-device init: it materializes a parameter through one of its modules
    (`to_empty` + `reset_parameters`), so a tied one (an HF model's lm_head.weight, which is its
    embed_tokens.weight) would come apart, the other module keeping the meta tensor (0.6.1 then
    stops on "Parameter lm_head.weight not found in FSDP parameters")."""
    holders: Dict[int, list] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_meta:
                holders.setdefault(id(param), []).append((module, name, param))
    for held in holders.values():
        if len(held) < 2:
            continue
        old = held[0][2]
        new = torch.nn.Parameter(torch.empty_like(old, device=device), requires_grad=old.requires_grad)
        for module, name, _ in held:
            module._parameters[name] = new
        owner = next((m for m, _, _ in held if hasattr(m, "reset_parameters")), None)
        if owner is not None:
            with torch.no_grad():
                owner.reset_parameters()


def make_capturable(optimizer, device) -> None:
    """Turn a TE FusedAdam into its CUDA-graph-safe form (capturable=True) before its first step:
    LR and step counters become device tensors. torch's AdamW stays as it is: the loop steps it
    eagerly between replays, on the gradient views the graph writes."""
    if getattr(optimizer, "capturable", None) is None or optimizer.capturable:
        return
    optimizer.capturable = True
    optimizer._step_supports_amp_scaling = True
    match_capturable(optimizer, device)


def match_capturable(optimizer, device) -> None:
    """LR and per-group step counters in the form the optimizer steps with: device tensors when
    it is capturable, plain numbers otherwise. Also after loading a checkpoint, which may come
    from a run of the other kind."""
    capturable = bool(getattr(optimizer, "capturable", False))
    for group in optimizer.param_groups:
        lr = group["lr"]
        if capturable and not torch.is_tensor(lr):
            group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=device)
        elif not capturable and torch.is_tensor(lr):
            group["lr"] = float(lr)
        if "step" in group:  # TE FusedAdam keeps Adam's step count in the group
            step = group["step"]
            if capturable and not torch.is_tensor(step):
                group["step"] = torch.tensor([int(step)], dtype=torch.int, device=device)
            elif not capturable and torch.is_tensor(step):
                group["step"] = int(step)


def reset_step_counters(optimizer) -> None:
    """Step counts back to 0 after fully_shard_optimizer's synthetic step (per-param state for
    torch.optim, per-group 'step' for TE FusedAdam)."""
    for st in optimizer.state.values():
        if "step" in st:
            if torch.is_tensor(st["step"]):
                st["step"].zero_()
            else:
                st["step"] = 0
    for group in optimizer.param_groups:
        if "step" in group:
            if torch.is_tensor(group["step"]):
                group["step"].zero_()
            else:
                group["step"] = 0


def full_tensor(t) -> torch.Tensor:
    """The full tensor of an (unevenly sharded) Megatron-FSDP DTensor; collective."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    from megatron_fsdp.uneven_dtensor import uneven_dtensor_to_full_tensor

    return uneven_dtensor_to_full_tensor(t)


def _to_plain(v):
    """A replicated DTensor -> its (full) local tensor; anything else unchanged."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(v, DTensor):
        if not all(isinstance(p, Replicate) for p in v.placements):
            raise RuntimeError(f"expected a replicated DTensor under no_shard, got {v.placements}")
        # detach(): a new tensor object on the same storage, without the DCP hooks Megatron-FSDP
        # attaches to its local tensors.
        return v._local_tensor.detach()
    return v


def _like(v, ref):
    """Wrap a loaded plain tensor back into a DTensor shaped like `ref` (when ref is one)."""
    from torch.distributed.tensor import DTensor

    if isinstance(ref, DTensor) and isinstance(v, torch.Tensor) and not isinstance(v, DTensor):
        return DTensor.from_local(v.to(ref.device), device_mesh=ref.device_mesh, placements=ref.placements,
                                  run_check=False, shape=ref.shape, stride=ref.stride())
    return v
