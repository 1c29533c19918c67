"""Checks on a resolved config, run in the launcher before any process starts. They only check
(planner/resolve.py fills derived values); each rule lives with the concept that owns it and is
called from here: mesh degrees in mesh.py, strategy rules in core/sharding.py, engine
capabilities in engines/, model rules in each model family (asked by planner/model_checks.py),
the loop's and the optimizer's in planner/train_checks.py, data rules in data.py."""

from __future__ import annotations

from typing import List, Optional

from ..core.dtypes import Dtype
from ..core.errors import ConfigError, check_at_least
from ..core.fp8 import FP8Recipe, on_linears
from ..core import k8s, storage
from ..core.schema import KUBERNETES_KINDS, CudaGraphMode, LauncherKind, ResumeMode
from ..core.schema import KeepBest
from ..core.sharding import ZeroStrategy, check_sharding, single_node_outer_warning
from ..engines import ENGINES, EngineCaps, engine_caps
from ..mesh import ParallelDims, world_size
from ..models import FAMILIES, family, te_names
from . import machine
from .model_checks import check_model
from .train_checks import check_optim, check_train


def validate(cfg, dims: Optional[ParallelDims] = None, *, check_hardware: bool = True) -> List[str]:
    """Check a resolved `cfg` (with the degrees `resolve` returned); returns warnings.
    `check_hardware=False` for dry runs and sbatch."""
    warnings: List[str] = []
    caps = engine_caps(cfg.engine.name)
    _check_launcher(cfg.launcher)
    if cfg.launcher.kind in KUBERNETES_KINDS:
        k8s.check(cfg.launcher)
        k8s.resource_name(cfg.run.name)
    _check_run_location(cfg.run, cfg.launcher)
    dims = dims or ParallelDims.from_config(cfg.mesh, world_size(cfg.launcher))
    _check_mesh(cfg.mesh, dims, caps)
    warnings += _check_sharding(cfg, dims, caps)
    warnings += _check_precision(cfg.precision, caps)
    _check_fp8(cfg, caps)
    warnings += check_model(cfg, dims, caps)
    _check_data(cfg)
    warnings += check_train(cfg, caps)
    check_optim(cfg.optim, dims, caps)
    _check_checkpoint(cfg.checkpoint)
    _check_keep_best(cfg)
    if check_hardware and cfg.launcher.kind == LauncherKind.torchrun:
        if not machine.local_gpu_count():  # (before importing what they would need)
            machine.refuse_gpu_only(cfg, "this machine has no CUDA GPU")
        machine.check_installs(cfg, probe=True)
        machine.check_gpus(cfg)
        machine.check_fused_optim(cfg)
        warnings += _check_memory(cfg, dims)
    else:
        # A dry run or an sbatch script is prepared on a machine that need not run it.
        try:
            machine.check_installs(cfg, probe=False)
        except ConfigError as exc:
            warnings.append(f"on this machine: {exc}")
    if cfg.launcher.nnodes > 1:
        warnings.extend(dims.cross_node_warnings(cfg.launcher.nproc_per_node))
    return warnings


def _check_run_location(run, lc) -> None:
    """run.dir: a directory or an object store (core/storage.py); run.local_dir goes with the latter."""
    if not storage.is_remote(run.dir):
        if run.local_dir is not None:
            raise ConfigError("run.local_dir", f"is for an object-store run.dir; run.dir={run.dir} is a directory",
                              "null, or run.dir=s3://BUCKET/PATH")
        return
    storage.check_url(str(run.dir))
    if lc.kind != LauncherKind.torchrun:
        raise ConfigError("run.dir", f"{run.dir}: an object-store run.dir runs under launcher=torchrun only (the "
                          f"{lc.kind} job's nodes share a directory instead)", "a directory every node mounts")


def _check_launcher(lc) -> None:
    check_at_least(lc, "launcher", ("nproc_per_node", "nnodes"), 1)
    if not 0 <= lc.node_rank < lc.nnodes:
        raise ConfigError("launcher.node_rank", f"{lc.node_rank} is not a node of {lc.nnodes}",
                          f"0..{lc.nnodes - 1}")
    if lc.kind == LauncherKind.torchrun and lc.nnodes > 1 and not lc.rdzv_endpoint:
        raise ConfigError("launcher.rdzv_endpoint", f"is needed with launcher.nnodes={lc.nnodes}",
                          "host:port of node 0, the same on every node")
    if lc.rdzv_endpoint and ":" not in lc.rdzv_endpoint:
        raise ConfigError("launcher.rdzv_endpoint", f"{lc.rdzv_endpoint!r} has no port", "host:port")


def _check_mesh(mesh_cfg, dims: ParallelDims, caps: EngineCaps) -> None:
    if mesh_cfg.enabled:
        return
    if not caps.default_mesh:
        raise ConfigError("mesh.enabled", f"false (the engine's default mesh) needs an engine that builds "
                          f"its own; engine={caps.name} does not", "true")
    if (dims.dp_outer, dims.cp, dims.tp) != (1, 1, 1):
        raise ConfigError("mesh.enabled", "false builds a plain FSDP mesh; it cannot have "
                          f"dp_outer/cp/tp > 1 (got {tuple(dims.shape)})", "mesh.dp_outer=1 mesh.cp=1 mesh.tp=1")


def _check_sharding(cfg, dims: ParallelDims, caps: EngineCaps) -> List[str]:
    zero, outer = cfg.sharding.zero_dp_strategy, cfg.sharding.outer_dp_sharding_strategy
    if zero not in caps.zero:
        raise ConfigError("sharding.zero_dp_strategy", f"engine={caps.name} cannot do {zero}; {caps.why_not}",
                          sorted(z.name for z in caps.zero))
    if outer not in caps.outer:
        raise ConfigError("sharding.outer_dp_sharding_strategy", f"engine={caps.name} cannot do {outer}; "
                          f"{caps.why_not}", sorted(o.name for o in caps.outer))
    warnings = single_node_outer_warning(dims.dp_outer, cfg.launcher.nnodes, dims.world_size)
    return warnings + check_sharding(zero, outer, dp_outer=dims.dp_outer,
                                     meta_init=cfg.model.init_on_meta and caps.name == "megatron_fsdp")


def _check_precision(pc, caps: EngineCaps) -> List[str]:
    if pc.main_params_dtype not in caps.main_params_dtypes:
        raise ConfigError("precision.main_params_dtype", f"{pc.main_params_dtype} main weights lose "
                          f"updates; engine={caps.name} keeps its sharded params in this dtype",
                          sorted(str(d) for d in caps.main_params_dtypes if d is not None) + ["null"])
    if pc.compute_dtype == Dtype.fp16:
        return ["precision.compute_dtype=fp16 has no loss scaling here; bf16 is safer"]
    return []


def _check_fp8(cfg, caps: EngineCaps) -> None:
    from ..components import float8

    f = cfg.fp8
    float8.check_weight_cache(f, grad_accum_steps=int(cfg.train.grad_accum_steps), caps=caps,
                              wired=[name for name, c in ENGINES.items() if c.fp8_weight_cache])
    if f.recipe == FP8Recipe.none:
        if f.params:
            raise ConfigError("fp8.params", "true has no effect with fp8.recipe=none", "false, or an fp8.recipe")
        if f.skip:
            raise ConfigError("fp8.skip", "has no effect with fp8.recipe=none", "[], or an fp8.recipe")
        if f.attention:
            raise ConfigError("fp8.attention", "true has no effect with fp8.recipe=none", "false, or fp8.recipe=delayed")
        return
    if on_linears(f.recipe):
        float8.check_config(f, supported=family(cfg.model.name).support(caps).fp8, model=cfg.model.name,
                            tp=int(cfg.mesh.tp), linear_models=[n for n, fam in FAMILIES.items() if fam.linear_fp8])
        return
    if f.attention and f.recipe != FP8Recipe.delayed:
        # Under current scaling TE 2.20 found no attention backend for te_gpt 8b's layers (GQA, seq
        # 8192, one H100, session 38), after the launch; delayed is the scaling that ran
        raise ConfigError("fp8.attention", f"FP8 attention runs here under delayed scaling only, not '{f.recipe}'",
                          "false, or fp8.recipe=delayed")
    if f.attention and cfg.mesh.cp > 1:
        # TE's context-parallel attention has FP8 paths, but none was run here
        raise ConfigError("fp8.attention", "with mesh.cp > 1 is not tested here", "false, or mesh.cp=1")
    if f.attention and cfg.data.doc_mask:
        # TE 2.x's FP8 attention (cuDNN) takes bshd/sbhd only; in training nothing else runs it in FP8
        raise ConfigError("fp8.attention", "true has no kernel for data.doc_mask's variable-length (THD) attention",
                          "false, or data.doc_mask=false")
    if f.skip and f.params:
        raise ConfigError("fp8.skip", "modules built with FP8 weights cannot run in high precision",
                          "[] with fp8.params=true, or fp8.params=false")
    if not family(cfg.model.name).has_te_layers:
        raise ConfigError("fp8.recipe", f"'{f.recipe}' would do nothing: model={cfg.model.name} has no "
                          "Transformer Engine layers", "none, model=" + "|".join(te_names())
                          + (", or fp8.recipe=torchao_tensorwise|torchao_rowwise|fused_rowwise (no TE)"
                             if family(cfg.model.name).linear_fp8 else ""))
    if f.amax_history_len < 1:
        raise ConfigError("fp8.amax_history_len", f"must be >= 1, got {f.amax_history_len}")
    if not f.params:
        return
    if not caps.fp8_params:
        raise ConfigError("fp8.params", f"FP8 parameters need an engine that shards them; engine={caps.name} "
                          "does not", "false, or engine=megatron_fsdp")
    if cfg.sharding.zero_dp_strategy != ZeroStrategy.optim_grads_params:
        raise ConfigError("fp8.params", "FP8 parameters need sharding.zero_dp_strategy=optim_grads_params, "
                          f"got {cfg.sharding.zero_dp_strategy}", "false")
    if cfg.precision.main_params_dtype is None:
        raise ConfigError("precision.main_params_dtype", "null, but FP8 parameters need high-precision "
                          "main weights", "fp32|fp64")
    if f.recipe != FP8Recipe.mxfp8 and not cfg.engine.keep_fp8_transpose_cache:
        raise ConfigError("engine.keep_fp8_transpose_cache", "false, but FP8 parameters need it (except "
                          "mxfp8)", "true")


def _check_memory(cfg, dims: ParallelDims) -> List[str]:
    """The dry run's estimate against the GPU's memory (planner/memory.py), GPU runs only."""
    from .memory import check_fits, check_host_fits, estimate, gpu_memory_bytes

    if cfg.engine.backend == "gloo":
        return []
    msgs = [check_fits(estimate(cfg, dims).total, gpu_memory_bytes(), force=cfg.launcher.force_memory),
            check_host_fits(cfg, dims)]  # train.cpu_offload's host memory
    return [m for m in msgs if m]


def _check_data(cfg) -> None:
    from ..data import check_data_config, loss_masked_source

    fam = family(cfg.model.name)
    check_data_config(cfg.data, vocab_size=fam.vocab_size(cfg.model), train=cfg.train)
    caps = engine_caps(cfg.engine.name)
    if cfg.data.doc_mask and not fam.support(caps).doc_mask:
        if fam.doc_mask:  # the family masks documents, not under this engine
            engines = [f"engine={e}" for e, c in ENGINES.items() if fam.support(c).doc_mask]
            raise ConfigError("data.doc_mask", f"model={fam.name} cannot mask attention per document under "
                              f"engine={caps.name}", ["false"] + engines)
        raise ConfigError("data.doc_mask", f"model={fam.name} cannot mask attention per document",
                          ["false"] + [f"model={name}" for name, f in FAMILIES.items() if f.support(caps).doc_mask])
    if cfg.data.doc_mask and cfg.train.cuda_graph == CudaGraphMode.full_iteration:
        raise ConfigError("train.cuda_graph", "full_iteration replays one fixed step, but data.doc_mask=true cuts "
                          "each batch at its documents (variable-length attention)", "none, or data.doc_mask=false")
    masked = loss_masked_source(cfg.data)
    if masked is None:
        return
    # A loss mask: the loop weighs micro-batches by their target tokens (rank/token_weights.py).
    if cfg.train.cuda_graph == CudaGraphMode.full_iteration:
        raise ConfigError("train.cuda_graph", f"full_iteration replays one fixed step, but {masked} has a loss "
                          "mask, whose micro-batches are weighed by their target tokens", "none")
    if fam.averages_own_loss(cfg.model):
        raise ConfigError("model.loss", f"model: the model averages its own loss, but {masked} has a loss mask, "
                          "whose micro-batches are weighed by their target tokens", "cross_entropy")


def _check_keep_best(cfg) -> None:
    """checkpoint.keep_best=val_loss ranks checkpoints by validation: there must be validation."""
    from ..data import has_validation

    if cfg.checkpoint.keep_best == KeepBest.val_loss and not has_validation(cfg.data):
        raise ConfigError("checkpoint.keep_best", f"val_loss needs validation, and data={cfg.data.name} holds "
                          "none out", "none, or data.val_fraction / data.val_sources")


def _check_checkpoint(ck) -> None:
    if ck.interval < 0:
        raise ConfigError("checkpoint.interval", f"must be >= 0, got {ck.interval}",
                          "0 (final save only) or a step count")
    if ck.keep_last < 1:
        raise ConfigError("checkpoint.keep_last", f"must be >= 1, got {ck.keep_last}")
    if ck.load_step is not None and ck.load_step < 0:
        raise ConfigError("checkpoint.load_step", f"must be >= 0, got {ck.load_step}")
    if ck.load_weights_only and not ck.load_path:
        raise ConfigError("checkpoint.load_weights_only", "needs checkpoint.load_path", "false")
    if ck.load_step is not None and ck.resume == ResumeMode.never:
        raise ConfigError("checkpoint.load_step", "conflicts with checkpoint.resume=never", "null")
    if ck.interval_minutes is not None and not ck.interval_minutes > 0:
        raise ConfigError("checkpoint.interval_minutes", f"must be > 0, got {ck.interval_minutes}",
                          "minutes of training between saves, or null (by checkpoint.interval only)")
    if ck.overwrite and ck.resume != ResumeMode.never:
        raise ConfigError("checkpoint.overwrite", f"true does nothing with checkpoint.resume={ck.resume}: it "
                          "only lets resume=never start over in a run dir with checkpoints",
                          "false, or checkpoint.resume=never")
