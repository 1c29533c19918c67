"""Semantic checks on a composed config, run in the launcher before any process starts.

Each rule raises ConfigError naming the key, the problem and what is allowed. `validate` also
normalizes what users may spell two ways (ZeRO strategies as names or numbers, dp_shard=-1)
and returns warnings. Pure Python: no torch, so the dry run stays fast.
"""

from __future__ import annotations

import fnmatch
import importlib.util
from typing import List

from . import schema as S
from .errors import ConfigError
from .hardware import local_gpu_count
from .mesh import ParallelDims

TE_MODELS = ("te_gpt", "te_toy_transformer")


def normalize_strategy(key: str, value, names) -> str:
    if isinstance(value, bool):
        raise ConfigError(key, f"got {value!r}", _spelled(names))
    if isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()):
        index = int(value)
        if 0 <= index < len(names):
            return names[index]
        raise ConfigError(key, f"{index} is out of range", _spelled(names))
    if isinstance(value, str) and value in names:
        return value
    raise ConfigError(key, f"unknown strategy {value!r}", _spelled(names))


def _spelled(names) -> str:
    return "|".join(names) + " or " + "|".join(str(i) for i in range(len(names)))


def _one_of(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(key, f"unknown value {value!r}", allowed)


def world_size(launcher_cfg) -> int:
    return launcher_cfg.nnodes * launcher_cfg.nproc_per_node


def validate(cfg, *, check_hardware: bool = True) -> List[str]:
    """Check `cfg` in place; returns warnings. `check_hardware=False` for dry runs and sbatch."""
    warnings: List[str] = []
    _check_names(cfg)
    _check_launcher(cfg.launcher)
    dims = _check_mesh(cfg)
    _check_sharding(cfg, dims)
    _check_precision(cfg, warnings)
    _check_fp8(cfg)
    _check_model(cfg, dims)
    _check_train(cfg, warnings)
    _check_checkpoint(cfg.checkpoint)
    if check_hardware and cfg.launcher.kind == "torchrun":
        _check_installs(cfg, probe=True)
        _check_gpus(cfg)
    else:
        # A dry run or an sbatch script is prepared on a machine that need not run it.
        try:
            _check_installs(cfg, probe=False)
        except ConfigError as exc:
            warnings.append(f"on this machine: {exc}")
    if cfg.launcher.nnodes > 1:
        warnings.extend(dims.cross_node_warnings(cfg.launcher.nproc_per_node))
    return warnings


def _check_names(cfg) -> None:
    _one_of("engine", cfg.engine.name, S.ENGINES)
    _one_of("model", cfg.model.name, S.MODELS)
    _one_of("data", cfg.data.name, S.DATASETS)
    _one_of("launcher", cfg.launcher.kind, S.LAUNCHER_KINDS)
    _one_of("train.cuda_graph", cfg.train.cuda_graph, S.CUDA_GRAPH_MODES)
    _one_of("optim.impl", cfg.optim.impl, S.OPTIM_IMPLS)
    _one_of("checkpoint.resume", cfg.checkpoint.resume, S.RESUME_MODES)
    _one_of("fp8.recipe", cfg.fp8.recipe, S.FP8_RECIPES)
    _one_of("fp8.format", cfg.fp8.format, S.FP8_FORMATS)
    if cfg.engine.backend is not None:
        _one_of("engine.backend", cfg.engine.backend, ("nccl", "gloo"))


def _check_launcher(lc) -> None:
    if lc.nproc_per_node < 1:
        raise ConfigError("launcher.nproc_per_node", f"must be >= 1, got {lc.nproc_per_node}")
    if lc.nnodes < 1:
        raise ConfigError("launcher.nnodes", f"must be >= 1, got {lc.nnodes}")
    if not 0 <= lc.node_rank < lc.nnodes:
        raise ConfigError("launcher.node_rank", f"{lc.node_rank} is not a node of {lc.nnodes}",
                          f"0..{lc.nnodes - 1}")
    if lc.kind == "torchrun" and lc.nnodes > 1 and not lc.rdzv_endpoint:
        raise ConfigError("launcher.rdzv_endpoint", f"is needed with launcher.nnodes={lc.nnodes}",
                          "host:port of node 0, the same on every node")
    if lc.rdzv_endpoint and ":" not in lc.rdzv_endpoint:
        raise ConfigError("launcher.rdzv_endpoint", f"{lc.rdzv_endpoint!r} has no port", "host:port")


def _check_mesh(cfg) -> ParallelDims:
    dims = ParallelDims.from_config(cfg.mesh, world_size(cfg.launcher))
    cfg.mesh.dp_shard = dims.dp_shard  # freeze the inferred degree into the run's config
    if not cfg.mesh.enabled:
        if cfg.engine.name != "megatron_fsdp":
            raise ConfigError("mesh.enabled", "false (the engine's default mesh) needs "
                              "engine=megatron_fsdp", "true")
        check_no_mesh(dims)
    return dims


def check_megatron_sharding(zero: str, outer: str, *, dp_outer: int, init_on_meta: bool) -> None:
    """Megatron-FSDP's own limits on the strategies (shared with the engine's argument mapping)."""
    if outer == "optim":
        if zero != "optim_grads_params":
            raise ConfigError("sharding.outer_dp_sharding_strategy",
                              f"'optim' (HFSDP) needs zero_dp_strategy=optim_grads_params, got {zero}",
                              "no_shard, or zero_dp_strategy=optim_grads_params")
        if dp_outer < 2:
            raise ConfigError("sharding.outer_dp_sharding_strategy",
                              "'optim' shards across dp_outer, but mesh.dp_outer=1",
                              "no_shard, or mesh.dp_outer > 1")
    if init_on_meta and zero == "no_shard":
        raise ConfigError("model.init_on_meta", "Megatron-FSDP refuses meta-device init with "
                          "zero_dp_strategy=no_shard", "false, or a sharded zero_dp_strategy")


def check_no_mesh(dims: ParallelDims) -> None:
    """mesh.enabled=false lets Megatron-FSDP build a flat FSDP mesh: no other dims."""
    if (dims.dp_outer, dims.cp, dims.tp) != (1, 1, 1):
        raise ConfigError("mesh.enabled", "false builds a plain FSDP mesh; it cannot have "
                          f"dp_outer/cp/tp > 1 (got {tuple(dims.shape)})", "mesh.dp_outer=1 mesh.cp=1 mesh.tp=1")


def _check_sharding(cfg, dims: ParallelDims) -> None:
    sh = cfg.sharding
    zero = normalize_strategy("sharding.zero_dp_strategy", sh.zero_dp_strategy, S.ZERO_STRATEGIES)
    outer = normalize_strategy("sharding.outer_dp_sharding_strategy", sh.outer_dp_sharding_strategy,
                               S.OUTER_STRATEGIES)
    sh.zero_dp_strategy, sh.outer_dp_sharding_strategy = zero, outer
    # HFSDP's two rules hold for both engines (FSDP2 refuses outer optim below anyway).
    check_megatron_sharding(zero, outer, dp_outer=dims.dp_outer,
                            init_on_meta=cfg.model.init_on_meta and cfg.engine.name == "megatron_fsdp")
    if cfg.engine.name == "fsdp2":
        if zero == "optim":
            raise ConfigError("sharding.zero_dp_strategy", "FSDP2 cannot shard only the optimizer "
                              "state (ZeRO-1); use engine=megatron_fsdp",
                              "no_shard|optim_grads|optim_grads_params with engine=fsdp2")
        if outer == "optim":
            raise ConfigError("sharding.outer_dp_sharding_strategy", "FSDP2 has no HFSDP (outer "
                              "optimizer sharding); use engine=megatron_fsdp", "no_shard with engine=fsdp2")
        if dims.cp > 1 or dims.tp > 1:
            raise ConfigError("mesh.cp" if dims.cp > 1 else "mesh.tp",
                              "engine=fsdp2 here shards over the data-parallel dims only",
                              "1 with engine=fsdp2, or engine=megatron_fsdp")


def check_precision_dtypes(precision_cfg, allowed) -> None:
    """Every dtype key is unset or one of `allowed` (shared with the engine's argument mapping)."""
    for key in ("compute_dtype", "main_params_dtype", "main_grads_dtype", "grad_comm_dtype"):
        value = getattr(precision_cfg, key)
        if value is not None and value not in allowed:
            raise ConfigError(f"precision.{key}", f"unknown dtype {value!r}", allowed)


def _check_precision(cfg, warnings: List[str]) -> None:
    pc = cfg.precision
    check_precision_dtypes(pc, S.DTYPES + ("null",))
    if pc.compute_dtype is None:
        pc.compute_dtype = "fp32"
    if pc.compute_dtype == "fp16":
        warnings.append("precision.compute_dtype=fp16 has no loss scaling here; bf16 is safer")
    if cfg.engine.name == "fsdp2" and pc.main_params_dtype not in (None, "fp32", "fp64"):
        raise ConfigError("precision.main_params_dtype", f"{pc.main_params_dtype} main weights lose "
                          "updates; FSDP2 keeps its sharded params in this dtype", "fp32|fp64|null")


def _check_fp8(cfg) -> None:
    f = cfg.fp8
    if f.recipe == "none":
        if f.params:
            raise ConfigError("fp8.params", "true has no effect with fp8.recipe=none",
                              "false, or an fp8.recipe")
        if f.skip:
            raise ConfigError("fp8.skip", "has no effect with fp8.recipe=none", "[], or an fp8.recipe")
        return
    if f.skip and f.params:
        raise ConfigError("fp8.skip", "modules built with FP8 weights cannot run in high precision",
                          "[] with fp8.params=true, or fp8.params=false")
    if cfg.model.name not in TE_MODELS:
        raise ConfigError("fp8.recipe", f"'{f.recipe}' would do nothing: model={cfg.model.name} "
                          "has no Transformer Engine layers", "none, or model=te_gpt|te_toy_transformer")
    if f.recipe == "blockwise" and f.format != "E4M3":
        f.format = "E4M3"  # Float8BlockScaling only has E4M3 tensors
    if f.amax_history_len < 1:
        raise ConfigError("fp8.amax_history_len", f"must be >= 1, got {f.amax_history_len}")
    if f.params:
        if cfg.engine.name != "megatron_fsdp":
            raise ConfigError("fp8.params", "FP8 parameters need engine=megatron_fsdp", "false")
        if cfg.sharding.zero_dp_strategy != "optim_grads_params":
            raise ConfigError("fp8.params", "FP8 parameters need sharding.zero_dp_strategy="
                              f"optim_grads_params, got {cfg.sharding.zero_dp_strategy}", "false")
        if cfg.precision.main_params_dtype is None:
            raise ConfigError("precision.main_params_dtype", "null, but FP8 parameters need "
                              "high-precision main weights", "fp32|fp64")
        if f.recipe != "mxfp8" and not cfg.engine.keep_fp8_transpose_cache:
            raise ConfigError("engine.keep_fp8_transpose_cache", "false, but FP8 parameters need it "
                              "(except mxfp8)", "true")


def _check_model(cfg, dims: ParallelDims) -> None:
    m, name = cfg.model, cfg.model.name
    from .models import sizes

    if name in ("gpt", "te_gpt"):
        try:
            gdims = sizes.resolve_gpt_dims(m)
        except ValueError as exc:
            raise _model_error(str(exc)) from None
        if gdims.dim % gdims.n_heads:
            raise ConfigError("model.dim", f"{gdims.dim} is not divisible by n_heads={gdims.n_heads}")
        if gdims.n_heads % gdims.n_kv_heads:
            raise ConfigError("model.n_kv_heads", f"{gdims.n_kv_heads} does not divide "
                              f"n_heads={gdims.n_heads}")
        if (gdims.dim // gdims.n_heads) % 2:
            raise ConfigError("model.dim", "head dim must be even for RoPE")
        if dims.tp > 1 or dims.cp > 1:
            raise ConfigError("mesh.tp" if dims.tp > 1 else "mesh.cp",
                              f"model={name} has no tensor/context parallelism yet", "1")
        if name == "te_gpt" and cfg.fp8.recipe != "none":
            _check_fp8_shapes(cfg, gdims)
        if cfg.data.name == "text" and gdims.vocab_size < 256:
            raise ConfigError("model.vocab_size", f"{gdims.vocab_size} is smaller than the byte "
                              "tokenizer's 256", ">= 256")
        heads = gdims.n_heads
    else:
        if cfg.data.name != "synthetic":
            raise ConfigError("data", f"model={name} trains on synthetic inputs, as the seed does",
                              "synthetic")
        heads = m.n_heads or 1
    if heads % dims.tp:
        raise ConfigError("mesh.tp", f"{dims.tp} does not divide the {heads} attention heads")
    if cfg.train.seq_len % dims.cp:
        raise ConfigError("train.seq_len", f"{cfg.train.seq_len} is not divisible by mesh.cp={dims.cp}")
    if m.params_dtype is not None:
        _one_of("model.params_dtype", m.params_dtype, S.DTYPES)
    elif name in TE_MODELS:
        # TE layers compute in their parameters' dtype (and FP8 weights keep it as the high-precision copy).
        m.params_dtype = cfg.precision.compute_dtype
    for pattern in m.freeze:
        if not pattern:
            raise ConfigError("model.freeze", "empty pattern", "parameter-name globs")
    if m.freeze or cfg.fp8.skip:
        _check_name_globs(cfg)


def _check_fp8_shapes(cfg, gdims) -> None:
    """FP8 GEMMs need every dimension divisible by 16; the head may be kept out via fp8.skip."""
    head_in_fp8 = not any(fnmatch.fnmatchcase("lm_head", p) for p in cfg.fp8.skip) and not gdims.tie_embeddings
    checks = [("model.dim", gdims.dim), ("model.ffn_dim", gdims.ffn_dim),
              ("train.micro_batch_size*train.seq_len", cfg.train.micro_batch_size * cfg.train.seq_len)]
    if head_in_fp8:
        checks.append(("model.vocab_size", gdims.vocab_size))
    for key, value in checks:
        if value % 16:
            hint = "or fp8.skip=[lm_head]" if key == "model.vocab_size" else "or fp8.recipe=none"
            raise ConfigError(key, f"{value} is not divisible by 16, which FP8 GEMMs need",
                              f"a multiple of 16, {hint}")


def _model_error(message: str) -> ConfigError:
    """sizes.py says 'model.KEY=...' or 'model.KEY ...' where it knows the key."""
    import re

    found = re.match(r"(model\.\w+)[= ]", message)
    return ConfigError(found.group(1) if found else "model.preset", message)


def _check_name_globs(cfg) -> None:
    """model.freeze globs must match parameters and fp8.skip globs modules, checked here on a
    meta-device model: in the worker, a miss would fail every rank after the spawn."""
    if cfg.model.name in TE_MODELS:
        names = _te_model_names(cfg)
        if names is None:
            return  # TE cannot build here (no TE or no GPU): the worker checks these globs
        params, modules = names
    else:
        params, modules = _meta_model_names(cfg.model, cfg.train.seq_len)
    if cfg.model.freeze:
        check_globs_match("model.freeze", cfg.model.freeze, params, "parameter")
    if cfg.fp8.skip:  # (_check_fp8 refused fp8.skip without a recipe)
        check_globs_match("fp8.skip", cfg.fp8.skip, modules, "module")


def _meta_model_names(model_cfg, seq_len: int):
    """(parameter names, module names) of the model built on the meta device."""
    import warnings

    import torch  # only paid for when model.freeze or fp8.skip is set

    from .models import build_model_spec

    spec = build_model_spec(model_cfg, seq_len)
    # Only the names are needed; a model's construction warnings would break the one-line error.
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = spec.build()
    return [n for n, _ in model.named_parameters()], [n for n, _ in model.named_modules() if n]


def _te_model_names(cfg):
    """_meta_model_names for a TE model, in a short-lived process: building TE layers may open a
    CUDA context, which the launcher must not hold on GPU 0 for the whole run. None when TE
    cannot build the model on this machine."""
    import json
    import subprocess
    import sys

    from omegaconf import OmegaConf

    if _import_problem("transformer_engine.pytorch", probe=False):
        return None
    code = ("import json, sys\n"
            "from mfsdp_launch.schema import ModelConfig\n"
            "from mfsdp_launch.validate import _meta_model_names\n"
            "spec = json.loads(sys.argv[1])\n"
            "print(json.dumps(_meta_model_names(ModelConfig(**spec['model']), spec['seq_len'])))\n")
    spec = {"model": OmegaConf.to_container(cfg.model, resolve=True), "seq_len": cfg.train.seq_len}
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True,
                              timeout=300)
        params, modules = json.loads(proc.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return None
    return params, modules


def check_globs_match(key: str, patterns, names, what: str) -> None:
    """Every glob must match one of `names`, or the setting would silently do nothing."""
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise ConfigError(key, f"{pattern!r} matches no {what}",
                              ", ".join(names[:6]) + (", ..." if len(names) > 6 else ""))


def _check_train(cfg, warnings: List[str]) -> None:
    t = cfg.train
    for key in ("steps", "micro_batch_size", "grad_accum_steps", "seq_len", "log_interval"):
        if getattr(t, key) < 1:
            raise ConfigError(f"train.{key}", f"must be >= 1, got {getattr(t, key)}")
    if t.stall_dump_s is not None and t.stall_dump_s <= 0:
        raise ConfigError("train.stall_dump_s", f"must be > 0, got {t.stall_dump_s}", "seconds, or null (off)")
    if t.grad_clip is not None and t.grad_clip <= 0:
        raise ConfigError("train.grad_clip", f"must be > 0, got {t.grad_clip}", "a positive number or null")
    o = cfg.optim
    if o.lr <= 0:
        raise ConfigError("optim.lr", f"must be > 0, got {o.lr}")
    if not 0 <= o.min_lr_ratio <= 1:
        raise ConfigError("optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    if o.warmup_steps < 0:
        raise ConfigError("optim.warmup_steps", f"must be >= 0, got {o.warmup_steps}")
    if o.impl == "te_fused" and cfg.engine.name != "megatron_fsdp":
        raise ConfigError("optim.impl", "te_fused (TE FusedAdam) is wired for engine=megatron_fsdp", "torch")
    if t.cuda_graph == "full_iteration":
        rules = [
            (cfg.engine.name == "megatron_fsdp", "engine", "megatron_fsdp"),
            (o.impl == "te_fused", "optim.impl", "te_fused (capturable FusedAdam)"),
            (not t.compile, "train.compile", "false"),
            (t.grad_accum_steps == 1, "train.grad_accum_steps", "1"),
            (cfg.sharding.zero_dp_strategy == "optim_grads_params", "sharding.zero_dp_strategy",
             "optim_grads_params"),
        ]
        for ok, key, allowed in rules:
            if not ok:
                raise ConfigError(key, "not supported with train.cuda_graph=full_iteration", allowed)
        pc = cfg.precision
        if pc.main_grads_dtype != pc.main_params_dtype and not cfg.engine.use_decoupled_grad:
            raise ConfigError("precision.main_grads_dtype", "must equal main_params_dtype under "
                              "full-iteration CUDA graphs (or set engine.use_decoupled_grad=true)",
                              str(pc.main_params_dtype))
    if cfg.engine.name == "fsdp2" and cfg.engine.keep_fp8_transpose_cache:
        warnings.append("engine.keep_fp8_transpose_cache only applies to engine=megatron_fsdp")


def _check_checkpoint(ck) -> None:
    if ck.interval < 0:
        raise ConfigError("checkpoint.interval", f"must be >= 0, got {ck.interval}", "0 (final save only) or a step count")
    if ck.keep_last < 1:
        raise ConfigError("checkpoint.keep_last", f"must be >= 1, got {ck.keep_last}")
    if ck.load_step is not None and ck.load_step < 0:
        raise ConfigError("checkpoint.load_step", f"must be >= 0, got {ck.load_step}")
    if ck.load_weights_only and not ck.load_path:
        raise ConfigError("checkpoint.load_weights_only", "needs checkpoint.load_path", "false")
    if ck.load_step is not None and ck.resume == "never":
        raise ConfigError("checkpoint.load_step", "conflicts with checkpoint.resume=never", "null")


def _import_problem(module: str, probe: bool) -> str:
    """'' if `module` imports; else why not, in one line. probe=False only looks for the package."""
    try:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            return "not installed"
    except (ImportError, ValueError):
        return "not installed"
    if not probe:
        return ""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module(module)
    except Exception as exc:  # a half-installed TE raises RuntimeError/OSError, not ImportError
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return f"installed but broken ({type(exc).__name__}: {first})"
    return ""


def _check_installs(cfg, probe: bool) -> None:
    """The engine and Transformer Engine import, before any process is spawned."""
    wanted = []
    if cfg.engine.name == "megatron_fsdp":
        wanted.append(("engine", "engine=megatron_fsdp", "megatron_fsdp", "pip install 'megatron-fsdp>=0.6.1'"))
    te_users = [("model", f"model={cfg.model.name}", cfg.model.name in TE_MODELS),
                ("fp8.recipe", f"fp8.recipe={cfg.fp8.recipe}", cfg.fp8.recipe != "none"),
                ("optim.impl", "optim.impl=te_fused", cfg.optim.impl == "te_fused")]
    for key, what, used in te_users:
        if used:
            wanted.append((key, what, "transformer_engine.pytorch", "pip install 'mfsdp-launch[te]'"))
            break
    for key, what, module, fix in wanted:
        problem = _import_problem(module, probe)
        if problem:
            raise ConfigError(key, f"{what} needs {module}, which is {problem}; {fix}")


def needs_cuda(cfg) -> str:
    """Why this config needs CUDA GPUs, or '' if it can run on CPU."""
    if cfg.engine.name == "megatron_fsdp":
        return "engine=megatron_fsdp runs on CUDA + NCCL only"
    if cfg.model.name in TE_MODELS:
        return f"model={cfg.model.name} (Transformer Engine) needs CUDA"
    if cfg.engine.backend == "nccl":
        return "engine.backend=nccl needs CUDA"
    return ""


def _check_gpus(cfg) -> None:
    why = needs_cuda(cfg)
    gpus = local_gpu_count()
    if why and gpus == 0:
        raise ConfigError("engine" if "engine" in why else "model", f"no CUDA GPU on this machine: {why}",
                          "engine=fsdp2 with a non-TE model for the CPU path, or launcher.dry_run=true")
    if gpus and (why or cfg.engine.backend != "gloo") and cfg.launcher.nproc_per_node > gpus:
        raise ConfigError("launcher.nproc_per_node", f"{cfg.launcher.nproc_per_node} processes but "
                          f"only {gpus} GPUs here", f"1..{gpus}")
