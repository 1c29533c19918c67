"""The training loop's and the optimizer's part of validation (planner/validate.py calls
check_train and check_optim): steps and schedules, bad-step rules, CUDA graphs, CPU offload, the
optimizer and its state dtype."""

from __future__ import annotations

from typing import List

from ..components.profiling import check_profile
from ..core.dtypes import OPTIM_STATE_DTYPES, Dtype
from ..core.errors import ConfigError, check_at_least
from ..core.fp8 import on_linears
from ..core.schema import Backend, CudaGraphMode, OptimImpl
from ..core.schema import OptimConfig, OptimName, Schedule
from ..core.sharding import ZeroStrategy
from ..engines import EngineCaps
from ..mesh import ParallelDims
from ..models import family, te_names
from . import machine


def _check_cpu_offload(cfg, caps: EngineCaps) -> None:
    if not caps.cpu_offload:
        raise ConfigError("train.cpu_offload", f"true needs engine=fsdp2: engine={caps.name} (Megatron-FSDP "
                          "0.6.1) has no CPU offload", "false, or engine=fsdp2")
    if not family(cfg.model.name).support(caps).cpu_offload:
        raise ConfigError("train.cpu_offload", f"true is not wired for model={cfg.model.name}'s Transformer "
                          "Engine layers", "false")


def check_train(cfg, caps: EngineCaps) -> List[str]:
    """train.* (and the optimizer rules that depend on it); returns warnings."""
    t, o = cfg.train, cfg.optim
    check_at_least(t, "train", ("steps", "micro_batch_size", "grad_accum_steps", "seq_len", "log_interval"), 1)
    if t.straggler_ratio != 0 and not t.straggler_ratio > 1:
        raise ConfigError("train.straggler_ratio", f"must be > 1, or 0 (off), got {t.straggler_ratio}",
                          "e.g. 1.5, or 0")
    if t.stall_dump_s is not None and t.stall_dump_s <= 0:
        raise ConfigError("train.stall_dump_s", f"must be > 0, got {t.stall_dump_s}", "seconds, or null (off)")
    check_profile(t.profile, t.steps)
    if t.cpu_offload:
        _check_cpu_offload(cfg, caps)
    if cfg.engine.backend == Backend.gloo:
        machine.refuse_gpu_only(cfg, "engine.backend=gloo runs on the CPU")
    if t.grad_clip is not None and t.grad_clip <= 0:
        raise ConfigError("train.grad_clip", f"must be > 0, got {t.grad_clip}", "a positive number or null")
    _check_bad_steps(t)
    if o.lr <= 0:
        raise ConfigError("optim.lr", f"must be > 0, got {o.lr}")
    if not 0 <= o.min_lr_ratio <= 1:
        raise ConfigError("optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    if o.warmup_steps < 0:
        raise ConfigError("optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    if o.impl == OptimImpl.te_fused and not caps.te_fused_optim:
        raise ConfigError("optim.impl", f"te_fused (TE FusedAdam) is not wired for engine={caps.name}", "torch")
    if cfg.engine.get("use_decoupled_grad", False) and o.impl not in (OptimImpl.te_fused, OptimImpl.triton):
        raise ConfigError("engine.use_decoupled_grad", "true puts the reduced gradients in param.decoupled_grad, "
                          f"which only TE's FusedAdam and optim.impl=triton read: optim.impl={o.impl} would find "
                          "no gradients and never update a weight", "false, or optim.impl=te_fused|triton")
    if cfg.engine.get("fuse_wgrad_accumulation", False):
        _check_wgrad_fusion(cfg)
    if t.cpu_offload and o.impl == OptimImpl.triton:
        raise ConfigError("optim.impl", "triton steps on CUDA tensors, and train.cpu_offload keeps the sharded "
                          "state in host memory", "torch|foreach")
    if t.cuda_graph == CudaGraphMode.full_iteration:
        _check_cuda_graph(cfg, caps)
    warnings = []
    if "nccl_ub" in cfg.engine and cfg.engine.nccl_ub:
        warnings.append("engine.nccl_ub: Megatron's NCCL allocator sets NCCL_NVLS_ENABLE=1 (NVLink multicast) in "
                        "every rank; on a host whose GPUs others share, keep it off")
    return warnings


def _check_wgrad_fusion(cfg) -> None:
    """engine.fuse_wgrad_accumulation acts on Transformer Engine layers, outside a captured graph."""
    if not family(cfg.model.name).has_te_layers:
        raise ConfigError("engine.fuse_wgrad_accumulation", f"true would do nothing: model={cfg.model.name} has "
                          "no Transformer Engine layers", "false, or model=" + "|".join(te_names()))
    if cfg.train.cuda_graph == CudaGraphMode.full_iteration:
        # TE asks Megatron-FSDP for the gradient buffer from inside its backward; never captured here
        raise ConfigError("engine.fuse_wgrad_accumulation", "true is not supported with "
                          "train.cuda_graph=full_iteration", "false")


def check_optim(o, dims: ParallelDims, caps: EngineCaps) -> None:
    """optim.name and the schedule's keys; the LR, warm-up and impl rules are check_train's."""
    defaults = OptimConfig()
    _check_state_dtype(o)
    if o.decay_steps is not None and o.decay_steps < 1:
        raise ConfigError("optim.decay_steps", f"must be >= 1, got {o.decay_steps}", "a step count, or null (train.steps)")
    if not 0 < o.decay_fraction <= 1:
        raise ConfigError("optim.decay_fraction", f"must be in (0, 1], got {o.decay_fraction}")
    if o.schedule != Schedule.wsd and o.decay_fraction != defaults.decay_fraction:
        raise ConfigError("optim.decay_fraction", f"is read by optim.schedule=wsd only, not {o.schedule}",
                          f"optim.schedule=wsd, or {defaults.decay_fraction}")
    if o.name != OptimName.muon:
        if o.muon_momentum != defaults.muon_momentum:
            raise ConfigError("optim.muon_momentum", f"is read by optim.name=muon only, not {o.name}",
                              f"optim.name=muon, or {defaults.muon_momentum}")
        return
    if not 0 <= o.muon_momentum < 1:
        raise ConfigError("optim.muon_momentum", f"must be in [0, 1), got {o.muon_momentum}")
    if not caps.muon:
        raise ConfigError("optim.name", f"muon is not wired for engine={caps.name}: its parameters are slices of "
                          "flat buffers, and Newton-Schulz over them was never run here", "adamw, or engine=fsdp2")
    if dims.tp > 1:
        raise ConfigError("optim.name", f"muon with mesh.tp={dims.tp} is not tested here (2-D dp x tp shards)",
                          "adamw, or mesh.tp=1")
    if o.impl != OptimImpl.torch:
        raise ConfigError("optim.impl", f"{o.impl} picks an AdamW kernel, but optim.name=muon runs its own update "
                          "(its AdamW part included)", "torch")


def _check_state_dtype(o) -> None:
    if o.state_dtype not in OPTIM_STATE_DTYPES:
        raise ConfigError("optim.state_dtype", f"{o.state_dtype} is not an optimizer-state dtype here",
                          [str(d) for d in OPTIM_STATE_DTYPES])
    if o.state_dtype == Dtype.fp32:
        return
    if o.name != OptimName.adamw:
        raise ConfigError("optim.state_dtype", f"{o.state_dtype} moments are AdamW's (components/adamw.py); "
                          f"optim.name={o.name} keeps its state in the parameters' dtype", "fp32, or optim.name=adamw")
    if o.impl != OptimImpl.torch:
        raise ConfigError("optim.state_dtype", f"{o.state_dtype} moments run in the launcher's AdamW, not "
                          f"optim.impl={o.impl}'s kernel", "fp32, or optim.impl=torch")


def _check_bad_steps(t) -> None:
    check_at_least(t, "train", ("max_bad_steps", "max_rollbacks"), 0)
    if not 0 < t.rollback_lr_scale <= 1:
        raise ConfigError("train.rollback_lr_scale", f"must be in (0, 1], got {t.rollback_lr_scale}",
                          "1 (the same LR) or a factor below 1")
    if t.spike_zscore is not None and not t.spike_zscore > 0:
        raise ConfigError("train.spike_zscore", f"must be > 0, got {t.spike_zscore}", "e.g. 6, or null (off)")


def _check_cuda_graph(cfg, caps: EngineCaps) -> None:
    """What a captured iteration holds still. The optimizer is not captured: it steps eagerly
    between replays on the gradients the graph wrote, so any AdamW kernel serves, and
    train.compile's kernels are captured like any other (its warm-up iterations compile)."""
    t, pc = cfg.train, cfg.precision
    rules = [
        (caps.cuda_graph, "engine", "megatron_fsdp"),
        (t.grad_accum_steps == 1, "train.grad_accum_steps", "1"),
        (cfg.sharding.zero_dp_strategy == ZeroStrategy.optim_grads_params, "sharding.zero_dp_strategy",
         "optim_grads_params"),
        # TE's fused loss was not captured in a graph here (its is_cg_capturable path is untested)
        (not machine.uses_fused_loss(cfg), "model.loss_kernel", "torch"),
        # FP8 linears (and the experts' FP8 grouped GEMM) were never captured here
        (not on_linears(cfg.fp8.recipe), "fp8.recipe", "none, or a TE recipe"),
    ]
    for ok, key, allowed in rules:
        if not ok:
            raise ConfigError(key, "not supported with train.cuda_graph=full_iteration", allowed)
    if pc.main_grads_dtype != pc.main_params_dtype and not cfg.engine.use_decoupled_grad:
        raise ConfigError("precision.main_grads_dtype", "must equal main_params_dtype under full-iteration "
                          "CUDA graphs (or set engine.use_decoupled_grad=true)", str(pc.main_params_dtype))
