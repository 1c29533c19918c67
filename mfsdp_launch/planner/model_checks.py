"""The model's part of validation (planner/validate.py calls check_model): the family's support answer
for the parallelism, activation checkpointing and experts the config asks of it, and its module globs."""

from __future__ import annotations

from typing import List

from omegaconf import OmegaConf

from ..core.errors import ConfigError
from ..core.globs import check_globs_match
from ..core.schema import ACMode, CudaGraphMode
from ..core.sharding import ZeroStrategy
from ..engines import ENGINES, EngineCaps
from ..mesh import ParallelDims
from ..models import FAMILIES, ModelContext, family, lora, qlora
from ..models.family import Parallel, Support
from ..models.meta import meta_names, meta_names_isolated


def check_model(cfg, dims: ParallelDims, caps: EngineCaps) -> List[str]:
    """The model family's own checks and what its support answer allows under this engine and
    mesh; returns warnings."""
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
