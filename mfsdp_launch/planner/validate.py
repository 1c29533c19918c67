"""Checks on a resolved config, run in the launcher before any process starts. They only check
(planner/resolve.py fills derived values); each rule lives with the concept that owns it and is
called from here: mesh degrees in mesh.py, strategy rules in core/sharding.py, engine
capabilities in engines/, model rules in each model family, data rules in data.py."""

from __future__ import annotations

from typing import List, Optional

from omegaconf import OmegaConf

from ..components.profiling import check_profile
from ..core.dtypes import OPTIM_STATE_DTYPES, Dtype
from ..core.errors import ConfigError
from ..core.fp8 import FP8Recipe, is_torchao
from ..core.globs import check_globs_match
from ..core import k8s, storage
from ..core.schema import KUBERNETES_KINDS, ACMode, Backend, CudaGraphMode, LauncherKind, OptimImpl, ResumeMode
from ..core.schema import KeepBest
from ..core.schema import OptimConfig, OptimName, Schedule
from ..core.sharding import ZeroStrategy, check_sharding, single_node_outer_warning
from ..engines import ENGINES, EngineCaps, engine_caps
from ..mesh import ParallelDims, world_size
from ..models import FAMILIES, ModelContext, family, lora, qlora
from ..models.family import Parallel, Support
from ..models.meta import meta_names, meta_names_isolated
from . import machine


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
    warnings += _check_model(cfg, dims, caps)
    _check_data(cfg)
    warnings += _check_train(cfg, caps)
    _check_optim(cfg.optim, dims, caps)
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
    for key in ("nproc_per_node", "nnodes"):
        if getattr(lc, key) < 1:
            raise ConfigError(f"launcher.{key}", f"must be >= 1, got {getattr(lc, key)}")
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
    f = cfg.fp8
    if f.recipe == FP8Recipe.none:
        if f.params:
            raise ConfigError("fp8.params", "true has no effect with fp8.recipe=none", "false, or an fp8.recipe")
        if f.skip:
            raise ConfigError("fp8.skip", "has no effect with fp8.recipe=none", "[], or an fp8.recipe")
        if f.attention:
            raise ConfigError("fp8.attention", "true has no effect with fp8.recipe=none", "false, or fp8.recipe=delayed|current")
        return
    if is_torchao(f.recipe):
        from ..components import float8

        float8.check_config(f, supported=family(cfg.model.name).support(caps).fp8, model=cfg.model.name,
                            tp=int(cfg.mesh.tp), torchao_models=[n for n, fam in FAMILIES.items() if fam.torchao_fp8])
        return
    if f.attention and f.recipe not in (FP8Recipe.delayed, FP8Recipe.current):
        raise ConfigError("fp8.attention", f"FP8 attention is wired for delayed and current scaling, not '{f.recipe}'",
                          "false, or fp8.recipe=delayed|current")
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
        te_models = [name for name, fam in FAMILIES.items() if fam.has_te_layers]
        raise ConfigError("fp8.recipe", f"'{f.recipe}' would do nothing: model={cfg.model.name} has no "
                          "Transformer Engine layers", "none, model=" + "|".join(te_models)
                          + (", or fp8.recipe=torchao_tensorwise|torchao_rowwise (torchao, no TE)"
                             if family(cfg.model.name).torchao_fp8 else ""))
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


def _check_model(cfg, dims: ParallelDims, caps: EngineCaps) -> List[str]:
    m, fam = cfg.model, family(cfg.model.name)
    ctx = ModelContext(tp=dims.tp, cp=dims.cp, seq_len=cfg.train.seq_len,
                       micro_batch_size=cfg.train.micro_batch_size, fp8_recipe=str(cfg.fp8.recipe),
                       fp8_skip=tuple(cfg.fp8.skip), fp8_params=bool(cfg.fp8.params),
                       data_name=str(cfg.data.name), engine=caps.name, ep=dims.ep)
    heads = fam.n_heads(m)
    if heads is not None and heads % dims.tp:
        raise ConfigError("mesh.tp", f"{dims.tp} does not divide the {heads} attention heads of model={fam.name}")
    warnings = fam.check(m, ctx)
    support = fam.support(caps)
    _check_experts(cfg, fam, support, caps, dims)
    _check_activation_checkpointing(m, fam.name, support)
    if dims.tp > 1:
        _check_tp(fam, support, caps)
    if dims.tp > 1 and cfg.data.doc_mask and support.tp == Parallel.TE:
        # te_gpt's THD path (models/llama/te_modules.py) runs unsplit; TE's sequence parallelism is not wired to it
        raise ConfigError("data.doc_mask", f"true with mesh.tp={dims.tp} is not wired for model={fam.name}'s TE layers",
                          "false, or mesh.tp=1")
    if dims.cp > 1:
        _check_cp(cfg, fam, support, caps)
    if dims.cp > 1 and cfg.train.seq_len % (2 * dims.cp):
        # models/cp_layout.py: each cp rank holds two of 2*cp equal chunks (load balance).
        raise ConfigError("train.seq_len", f"{cfg.train.seq_len} is not divisible by 2*mesh.cp={2 * dims.cp}",
                          f"a multiple of {2 * dims.cp}")
    if (m.freeze or cfg.fp8.skip) and not fam.measured:
        _check_name_globs(cfg, fam)
    lora.check_config(m, fam, seq_len=cfg.train.seq_len, tp=dims.tp,
                      cuda_graph=cfg.train.cuda_graph == CudaGraphMode.full_iteration,
                      lora_families=[name for name, f in FAMILIES.items() if f.lora])
    if qlora.enabled(m):
        qlora.check_config(engine=cfg.engine.name, fp8_recipe=str(cfg.fp8.recipe), compiled=bool(cfg.train.compile))
    return warnings


def _check_memory(cfg, dims: ParallelDims) -> List[str]:
    """The dry run's estimate against the GPU's memory (planner/memory.py), GPU runs only."""
    from .memory import check_fits, check_host_fits, estimate, gpu_memory_bytes

    if cfg.engine.backend == "gloo":
        return []
    msgs = [check_fits(estimate(cfg, dims).total, gpu_memory_bytes(), force=cfg.launcher.force_memory),
            check_host_fits(cfg, dims)]  # train.cpu_offload's host memory
    return [m for m in msgs if m]


def _engines_taking(kind: str, mode: str) -> str:
    return "|".join(name for name, c in ENGINES.items() if mode in getattr(c, kind))


def _check_tp(fam, support: Support, caps: EngineCaps) -> None:
    """tp > 1: the family's way of using tp (models/family.py's Parallel) must be one the engine takes."""
    if support.tp != Parallel.NONE:
        return
    if fam.tp_mode == Parallel.DTENSOR:
        raise ConfigError("mesh.tp", f"engine={caps.name} with model={fam.name}'s DTensor tensor parallelism is "
                          "not supported: Megatron-FSDP 0.6.1 takes DTensor parameters, but the DTensor plans "
                          "here (gpt's redistributes its fused weights inside forward) never ran on Megatron-FSDP's "
                          "swapped-in parameters", "1, engine=fsdp2, or model=te_gpt (TE's own TP)")
    raise ConfigError("mesh.tp", f"model={fam.name} has no tensor parallelism under engine={caps.name} yet", "1")


def _check_cp(cfg, fam, support: Support, caps: EngineCaps) -> None:
    """cp > 1: a family that splits sequences over cp (or replicates over the engine's cp, as the
    seed's toys do), in a way the engine takes."""
    if support.cp == Parallel.REPLICATE:
        return
    if fam.cp_mode not in Parallel.SPLITTING:
        cp_models = "|".join(name for name, f in FAMILIES.items() if f.cp_mode in Parallel.SPLITTING)
        raise ConfigError("mesh.cp", f"model={fam.name} has no context parallelism yet", f"1, or model={cp_models}")
    if support.cp == Parallel.NONE:
        # TE's context-parallel attention is wired and tested under Megatron-FSDP only.
        engines = _engines_taking("cp_modes", fam.cp_mode)
        raise ConfigError("mesh.cp", f"model={fam.name} runs context parallelism under engine={engines} only",
                          f"1, or engine={engines}")
    if cfg.data.doc_mask:
        raise ConfigError("data.doc_mask", f"a document mask with mesh.cp={cfg.mesh.cp} is not supported",
                          "false, or mesh.cp=1")


def _check_experts(cfg, fam, support: Support, caps: EngineCaps, dims: ParallelDims) -> None:
    """mesh.ep > 1 (the family checked that ep divides its experts; mesh.py that it divides
    dp_shard x cp), and what a mixture of experts does not run with."""
    if fam.expert_params(cfg.model) and cfg.train.cuda_graph == CudaGraphMode.full_iteration:
        raise ConfigError("train.cuda_graph", "full_iteration cannot capture a mixture of experts: its token "
                          "counts per expert change every step", "none")
    if dims.ep == 1:
        return
    if not support.expert_parallel:
        engines = "|".join(n for n, c in ENGINES.items() if c.expert_parallel)
        why = (f"model={fam.name} has no experts to split" if not fam.expert_parallel else
               f"engine={caps.name} does not split experts over mesh.ep yet (engines/__init__.py says why)")
        raise ConfigError("mesh.ep", f"{dims.ep}: {why}",
                          f"1, or engine={engines} with {fam.experts_from or 'model.moe'}")
    if cfg.sharding.zero_dp_strategy == ZeroStrategy.no_shard:
        raise ConfigError("sharding.zero_dp_strategy", f"no_shard with mesh.ep={dims.ep} is not wired: the "
                          "experts are sharded over their expert-data-parallel ranks", "optim_grads|optim_grads_params")


def _check_activation_checkpointing(m, name: str, support: Support) -> None:
    if m.ac_every < 1:
        raise ConfigError("model.ac_every", f"must be >= 1, got {m.ac_every}", "N: checkpoint every N-th block")
    if m.activation_checkpointing != ACMode.none and not support.activation_checkpointing:
        able = "|".join(n for n, f in FAMILIES.items() if f.activation_checkpointing)
        raise ConfigError("model.activation_checkpointing", f"{m.activation_checkpointing}: model={name} does not "
                          "wrap its layers for activation checkpointing", f"none, or model={able}")


def _check_name_globs(cfg, fam) -> None:
    """model.freeze globs must match parameters and fp8.skip globs modules, checked on a meta-device
    model here: in the worker, a miss would fail every rank after the spawn."""
    for key, patterns in (("model.freeze", cfg.model.freeze), ("fp8.skip", cfg.fp8.skip)):
        for pattern in patterns:
            if not pattern:
                raise ConfigError(key, "empty pattern", "name globs")
    if fam.has_te_layers:
        names = meta_names_isolated(OmegaConf.to_container(cfg.model, resolve=True, enum_to_str=True),
                                    cfg.train.seq_len)
        if names is None:
            return  # TE cannot build here (no TE or no GPU): the worker checks these globs
    else:
        names = meta_names(cfg.model, cfg.train.seq_len)
    params, modules = names
    if cfg.model.freeze:
        check_globs_match("model.freeze", cfg.model.freeze, params, "parameter")
    if cfg.fp8.skip:
        check_globs_match("fp8.skip", cfg.fp8.skip, modules, "module")


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


def _check_cpu_offload(cfg, caps: EngineCaps) -> None:
    if not caps.cpu_offload:
        raise ConfigError("train.cpu_offload", f"true needs engine=fsdp2: engine={caps.name} (Megatron-FSDP "
                          "0.6.1) has no CPU offload", "false, or engine=fsdp2")
    if not family(cfg.model.name).support(caps).cpu_offload:
        raise ConfigError("train.cpu_offload", f"true is not wired for model={cfg.model.name}'s Transformer "
                          "Engine layers", "false")


def _check_train(cfg, caps: EngineCaps) -> List[str]:
    t, o = cfg.train, cfg.optim
    for key in ("steps", "micro_batch_size", "grad_accum_steps", "seq_len", "log_interval"):
        if getattr(t, key) < 1:
            raise ConfigError(f"train.{key}", f"must be >= 1, got {getattr(t, key)}")
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
    if cfg.engine.get("use_decoupled_grad", False) and o.impl != OptimImpl.te_fused:
        raise ConfigError("engine.use_decoupled_grad", "true puts the reduced gradients in param.decoupled_grad, "
                          f"which only TE's FusedAdam reads: optim.impl={o.impl} would find no gradients and "
                          "never update a weight", "false, or optim.impl=te_fused")
    if t.cuda_graph == CudaGraphMode.full_iteration:
        _check_cuda_graph(cfg, caps)
    warnings = []
    if "nccl_ub" in cfg.engine and cfg.engine.nccl_ub:
        warnings.append("engine.nccl_ub: Megatron's NCCL allocator sets NCCL_NVLS_ENABLE=1 (NVLink multicast) in "
                        "every rank; on a host whose GPUs others share, keep it off")
    return warnings


def _check_optim(o, dims: ParallelDims, caps: EngineCaps) -> None:
    """optim.name and the schedule's keys; the LR, warm-up and impl rules are _check_train's."""
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
    for key in ("max_bad_steps", "max_rollbacks"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key}", f"must be >= 0, got {getattr(t, key)}")
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
        # torchao's layers (and the experts' FP8 grouped GEMM) were never captured here
        (not is_torchao(cfg.fp8.recipe), "fp8.recipe", "none, or a TE recipe"),
    ]
    for ok, key, allowed in rules:
        if not ok:
            raise ConfigError(key, "not supported with train.cuda_graph=full_iteration", allowed)
    if pc.main_grads_dtype != pc.main_params_dtype and not cfg.engine.use_decoupled_grad:
        raise ConfigError("precision.main_grads_dtype", "must equal main_params_dtype under full-iteration "
                          "CUDA graphs (or set engine.use_decoupled_grad=true)", str(pc.main_params_dtype))


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
