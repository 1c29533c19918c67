"""Per-rank memory estimate for the dry run: what each engine, ZeRO stage and outer strategy keeps
where at the moment memory peaks (the start of the backward pass).

A model of the engine's buffers, not a measurement, calibrated against the peaks measured on H200s
(bench/memory_reference.json; docs/memory.md explains each line):

* params: the compute-dtype weights a rank holds. Megatron-FSDP keeps a compute copy beside the
  main weights (sharded under ZeRO-3); FSDP2 keeps only the main weights sharded and casts at
  all-gather, so its line is 0 unless compute and main dtypes agree.
* main_params, grads, optimizer (Adam's two moments; under optim.name=muon one momentum buffer for
  the matrices it updates): divided by the ranks that shard them.
  FSDP2 frees gradients at `zero_grad` (set_to_none), so they are not alive at the peak unless
  gradients accumulate (train.grad_accum_steps > 1); Megatron-FSDP's gradient buffer is persistent.
* gathered_units: two FSDP units all-gathered (one computing, one prefetched) under ZeRO-3; with
  FSDP2 at ZeRO 0-2 the parameters stay unsharded from forward to backward: the whole model.
* activations and logits: from the model family (`activation_checkpointing`, `tp`), divided by
  `cp` (each context-parallel rank holds seq/cp tokens: models/cp_layout.py).
* LoRA (model.peft): the frozen base has compute-dtype weights only (no main copy, gradient or
  optimizer state); main weights, gradients and Adam's moments are the adapters' alone.
* fp8_weights: FP8 copies of the block weights, kept from forward to backward: TE's (FP8 recipes
  without fp8.params), and fused_rowwise's column casts of each weight (components/fp8_linear.py;
  one H100, the 8b's 8 layers: 2.0 GiB over bf16's peak, the head's included), or with
  fp8.cache_weight_casts both casts of every Linear weight, for the whole run (backward reads
  those: no other copy).
* allocator: the caching allocator's slack over what is allocated (`ALLOCATOR_SLACK` of the
  transient buffers): the estimate aims at the reserved peak, which is what runs out. FSDP2 with
  DTensor TP reserves about one more gradient copy (`_fsdp2_tp_reserve`).

Before a job spawns, `check_fits` compares the estimate with the GPU's memory (`gpu_memory_bytes`,
from nvidia-smi, no torch): a config that cannot fit is one line, unless `launcher.force_memory`.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import asdict, dataclass
from typing import Dict, Optional

from ..core.dtypes import Dtype
from ..core.fp8 import FP8Recipe
from ..core.schema import OptimName
from ..core.sharding import ZeroStrategy, shard_factors
from ..core.errors import ConfigError
from ..engines import engine_caps
from ..mesh import ParallelDims
from ..models import family, lora, qlora

GIB = 1024**3
# TE keeps each block's FP8 weight (1 byte per element) and part of its transpose from forward to
# backward: 1.25 bytes per block weight fits te_gpt d=4096 with 8 and 16 layers (+1.9 / +3.6 GiB).
FP8_WEIGHT_BYTES = 1.25
CACHED_CAST_BYTES = 2.0  # fp8.cache_weight_casts: a weight's row and column casts, one byte each
# Reserved minus allocated at the peak, as a fraction of activations + logits + gathered units
# (blocks of varying size that the caching allocator cannot always reuse).
ALLOCATOR_SLACK = 0.03


@dataclass
class MemoryEstimate:
    params: float
    main_params: float
    grads: float
    optimizer: float
    gathered_units: float
    activations: float
    logits: float = 0.0
    fp8_weights: float = 0.0
    allocator: float = 0.0
    # train.cpu_offload: the sharded state each rank keeps in host memory instead (not a GPU line).
    host: float = 0.0

    @property
    def total(self) -> float:
        return sum(self.as_dict().values())

    def as_dict(self) -> Dict[str, float]:
        """The GPU's lines (the dry run's table; `total` sums them)."""
        lines = asdict(self)
        lines.pop("host")
        return lines


def estimate(cfg, dims: ParallelDims) -> MemoryEstimate:
    fam, m, pc, t = family(cfg.model.name), cfg.model, cfg.precision, cfg.train
    n = fam.param_count(m)
    # (trainable, frozen) parameters: LoRA trains its adapters over a frozen base; QLoRA keeps the
    # base's linear layers but lm_head in NF4, whole on every rank (models/qlora.py).
    train_n, frozen_n, nf4_n = n, 0, 0
    if lora.enabled(m):
        modules = fam.modules(m, t.seq_len)
        train_n, frozen_n = lora.adapter_params(modules, m.peft), n
        nf4_n = qlora.nf4_params(modules) if qlora.enabled(m) else 0
        frozen_n -= nf4_n
    compute_b = Dtype(pc.compute_dtype or Dtype.fp32).bytes
    weight_b = 1 if cfg.fp8.params else compute_b  # fp8.params: the compute weights are FP8
    main_b = Dtype(pc.main_params_dtype).bytes if pc.main_params_dtype else 0
    if pc.main_params_dtype == pc.compute_dtype:
        main_b = 0  # the compute weights are the main weights
    grad_b = Dtype(pc.main_grads_dtype or pc.compute_dtype or Dtype.fp32).bytes
    optim_b = 2 * Dtype(pc.main_params_dtype or Dtype.fp32).bytes
    if cfg.optim.state_dtype != Dtype.fp32:  # components/adamw.py: the moments in optim.state_dtype
        optim_b = 2 * Dtype(cfg.optim.state_dtype).bytes
    # optim.name=muon: one momentum buffer for the matrices it updates (LoRA's adapters are all
    # 2-D matrices), Adam's two moments for the rest.
    muon_n = 0
    if OptimName(cfg.optim.name) is OptimName.muon:
        muon_n = train_n if lora.enabled(m) else min(fam.muon_matrix_params(m), train_n)
    zero = ZeroStrategy(cfg.sharding.zero_dp_strategy)
    f = shard_factors(zero, cfg.sharding.outer_dp_sharding_strategy, dims.shard_size, dims.dp_outer)
    # With model.fsdp_unit_modules overriding a built-in family's units they are unknown here: the
    # whole model bounds it. Measured families (custom, hf) know theirs.
    unit = n if m.fsdp_unit_modules and not fam.measured else fam.largest_unit_params(m)
    tp = dims.tp if fam.support(engine_caps(cfg.engine.name)).splits_over_tp else 1  # toys replicate
    if tp > 1:
        n, unit = _tp_params(fam, m, n, unit, tp)
        train_n, frozen_n = (train_n, n) if frozen_n else (n, 0)
    parts = fam.activation_parts(m, t.micro_batch_size, t.seq_len, compute_b, tp=tp, compiled=bool(t.compile))
    cp = max(dims.cp, 1)
    est = MemoryEstimate(
        params=(train_n + frozen_n) * weight_b / f["params"],
        main_params=train_n * main_b / f["main_params"],
        grads=train_n * grad_b / f["grads"],
        optimizer=(train_n - muon_n / 2) * optim_b / f["optimizer"],
        gathered_units=2 * unit * weight_b if f["params"] > 1 else 0.0,
        activations=parts["activations"] / cp,
        logits=parts["logits"] / cp,
        fp8_weights=_fp8_weight_bytes(cfg, fam, tp),
    )
    reserve = 0.0
    if cfg.engine.name == "fsdp2":
        _as_fsdp2(est, (train_n, frozen_n), unit, weight_b, main_b, grad_b, zero, dims, t.grad_accum_steps)
        _experts_over_ep(est, fam.expert_params(m), fam.unit_expert_params(m), weight_b, zero, dims)
        reserve = _fsdp2_tp_reserve(n, grad_b, zero, dims, tp)
    if nf4_n:  # never sharded, never gathered
        est.params += nf4_n * qlora.NF4_BYTES
        est.gathered_units *= (n - nf4_n) / n
    if t.cpu_offload:  # FSDP2's CPUOffloadPolicy: only gathered units and activations stay on the GPU
        # (FSDP2's sharded gradients take the sharded parameters' dtype)
        _offload_to_host(est, train_n * (main_b or weight_b) / _fsdp2_shards(zero, dims))
    est.allocator = ALLOCATOR_SLACK * (est.activations + est.logits + est.gathered_units) + reserve
    return est


def _fsdp2_tp_reserve(n: float, grad_b: int, zero: ZeroStrategy, dims: ParallelDims, tp: int) -> float:
    """Reserved, not allocated, under FSDP2 + DTensor TP: measured on H200 (bench/memory.md), the
    reserved peak exceeds the allocated one by about one sharded gradient copy (gpt 1.4b: +4.5 GiB
    over 2.8 GiB of gradients, 8b: +24.4 over 16.9), where tp=1 runs stay within 3-9 %. The
    gradients are born during backward while the activations die, and under TP the freed blocks
    do not serve them. Not profiled further; two points, so a fit, not a law."""
    return n * grad_b / _fsdp2_shards(zero, dims) if tp > 1 else 0.0


def _fsdp2_shards(zero: ZeroStrategy, dims: ParallelDims) -> int:
    """Ranks FSDP2 shards the state over: dp_shard (x cp); ZeRO 0 replicates (dp_outer > 1: HSDP,
    replicated over it)."""
    return 1 if zero is ZeroStrategy.no_shard else dims.shard_size


def _as_fsdp2(est: MemoryEstimate, counts: tuple, unit: float, weight_b: int, main_b: int, grad_b: int,
              zero: ZeroStrategy, dims: ParallelDims, grad_accum: int) -> None:
    """FSDP2 (engines/fsdp2.py): the sharded parameters are the main weights (one copy); ZeRO 2-3
    shard everything over dp_shard (x cp), ZeRO 0 replicates; below ZeRO-3 the compute-dtype copy of
    every unit stays gathered from forward to backward; gradients are freed at zero_grad.
    `counts`: (trainable, frozen) parameters; frozen ones are kept in the compute dtype."""
    train_n, frozen_n = counts
    n = train_n + frozen_n
    shards = _fsdp2_shards(zero, dims)
    if main_b:
        est.params, est.main_params = frozen_n * weight_b / shards, train_n * main_b / shards
    else:
        est.params, est.main_params = n * weight_b / shards, 0.0
    est.gathered_units = 2 * unit * weight_b if zero is ZeroStrategy.optim_grads_params else n * weight_b
    est.grads = train_n * grad_b / shards if grad_accum > 1 else 0.0


def _experts_over_ep(est: MemoryEstimate, n_experts: int, unit_experts: int, weight_b: int,
                     zero: ZeroStrategy, dims: ParallelDims) -> None:
    """mesh.ep > 1 (FSDP2 at ZeRO 2-3, what validation lets through): the sharded state is what it
    was (each rank's E/ep experts over edp = dp_shard*cp/ep ranks, the dense weights over
    dp_shard*cp), but what is all-gathered holds only the E/ep experts of the rank's ep slot."""
    if dims.ep == 1 or not n_experts:
        return
    gathered = 2 * unit_experts if zero is ZeroStrategy.optim_grads_params else n_experts
    est.gathered_units -= gathered * weight_b * (1 - 1 / dims.ep)


def expert_share(cfg, dims: ParallelDims, est: MemoryEstimate) -> float:
    """Bytes of the routed experts in the params, main_params, grads and optimizer lines (the dry
    run's expert/dense split): their share of the parameters, sharded as the dense ones are."""
    fam = family(cfg.model.name)
    n_experts = fam.expert_params(cfg.model)
    if not n_experts:
        return 0.0
    state = est.params + est.main_params + est.grads + est.optimizer
    return state * n_experts / fam.param_count(cfg.model)


def _fp8_weight_bytes(cfg, fam, tp: int) -> float:
    recipe = FP8Recipe(cfg.fp8.recipe)
    if recipe is FP8Recipe.none or cfg.fp8.params or not (fam.has_te_layers or recipe is FP8Recipe.fused_rowwise):
        return 0.0
    # fp8.cache_weight_casts: both casts of every Linear's weight, unsharded, for the whole run
    cached = CACHED_CAST_BYTES if recipe is FP8Recipe.fused_rowwise and cfg.fp8.cache_weight_casts else 0.0
    if not hasattr(fam, "dims"):  # TE toys, measured families: all their weights (under activation
        # checkpointing a measured family keeps about one unit's: its largest)
        n = fam.param_count(cfg.model)
        if cached:  # what backward reads are the cached buffers themselves (fp8_linear.py)
            return cached * n
        checkpointed = fam.measured and str(cfg.model.activation_checkpointing) != "none"
        return FP8_WEIGHT_BYTES * (fam.largest_unit_params(cfg.model) if checkpointed else n)
    from ..models.llama.dims import layer_params, live_blocks

    d = fam.dims(cfg.model)
    linear = layer_params(d) - 2 * d.dim
    head = 0 if d.tie_embeddings else d.dim * d.vocab_size
    if cached:  # what backward reads are the cached buffers themselves (fp8_linear.py)
        return cached * (d.n_layers * linear + head) / tp
    blocks = live_blocks(d, str(cfg.model.activation_checkpointing), cfg.model.ac_every)
    return FP8_WEIGHT_BYTES * blocks * linear / tp


def _tp_params(fam, m, n: int, unit: int, tp: int):
    """(params, largest unit) per rank under TP (models/llama/tensor_parallel.py, TE's tp_group): the blocks'
    linear weights split over tp; embedding, norms and head stay whole. When a block is the largest
    unit it shrinks too (if the root then becomes larger, this underestimates the gathered unit)."""
    from ..models.llama.dims import layer_params

    d = fam.dims(m)
    per_layer = layer_params(d) - 2 * d.dim
    if unit == layer_params(d):
        unit -= per_layer * (1 - 1 / tp)
    return n - d.n_layers * per_layer * (1 - 1 / tp), unit


HINT = "try model.activation_checkpointing=full, mesh.tp=2 or a smaller train.micro_batch_size"


def check_fits(needed_bytes: float, device_bytes: Optional[float], *, force: bool = False) -> Optional[str]:
    """Refuse (ConfigError) a per-GPU estimate above the device's memory; with `force`, return the
    same sentence as a warning. Nothing when the device memory is unknown (no GPU, no nvidia-smi)."""
    if device_bytes is None or needed_bytes <= device_bytes:
        return None
    msg = f"needs ~{needed_bytes / GIB:.1f} GiB per GPU, the GPU has {device_bytes / GIB:.1f}: {HINT}"
    if force:
        return msg + " (launcher.force_memory=true: starting anyway)"
    raise ConfigError("memory", msg, "launcher.force_memory=true to start anyway")


def gpu_memory_bytes() -> Optional[float]:
    """Total memory of the smallest visible NVIDIA GPU, from nvidia-smi (no torch, no CUDA init);
    None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return parse_memory_total(out)


def parse_memory_total(text: str) -> Optional[float]:
    """nvidia-smi's `memory.total` lines (MiB, one per GPU) -> bytes of the smallest GPU."""
    mib = [float(line) for line in (line.strip() for line in text.splitlines()) if line.replace(".", "", 1).isdigit()]
    return min(mib) * 1024**2 if mib else None


# --- train.cpu_offload: host memory ---------------------------------------------------------------

# Each rank process's own host memory besides the offloaded state: torch, the CUDA context, the
# pinned staging of one unit's copies. A rough figure (not profiled), so the line is an estimate.
HOST_PER_RANK = 3 * GIB


def _offload_to_host(est: MemoryEstimate, grads: float) -> None:
    """Sharded weights, gradients (alive from backward to the step, on the host) and Adam's
    moments move to host memory."""
    est.host = est.params + est.main_params + max(est.grads, grads) + est.optimizer
    est.params = est.main_params = est.grads = est.optimizer = 0.0


def host_bytes_per_node(cfg, dims: ParallelDims) -> Optional[float]:
    """Host memory one node needs under train.cpu_offload (its ranks' offloaded state plus
    HOST_PER_RANK each); None without offload."""
    if not cfg.train.cpu_offload:
        return None
    return cfg.launcher.nproc_per_node * (estimate(cfg, dims).host + HOST_PER_RANK)


def host_memory_bytes() -> Optional[float]:
    """This machine's physical memory (MemTotal of /proc/meminfo); None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_line(cfg, dims: ParallelDims) -> Optional[str]:
    """The dry run's host-memory line under train.cpu_offload."""
    need = host_bytes_per_node(cfg, dims)
    if need is None:
        return None
    have = host_memory_bytes()
    line = (f"host memory per node (train.cpu_offload): ~{need / GIB:.1f} GiB for "
            f"{cfg.launcher.nproc_per_node} rank(s)")
    if have is not None:
        line += f"; this machine has {have / GIB:.1f} GiB" + (" (a run here is refused)" if need > have else "")
    return line


def check_host_fits(cfg, dims: ParallelDims) -> Optional[str]:
    """Refuse (ConfigError) a train.cpu_offload run this host cannot hold; with
    launcher.force_memory, the same sentence as a warning."""
    need, have = host_bytes_per_node(cfg, dims), host_memory_bytes()
    if need is None or have is None or need <= have:
        return None
    msg = (f"needs ~{need / GIB:.1f} GiB of host memory per node for the offloaded state, this machine has "
           f"{have / GIB:.1f}: use more nodes (mesh.dp_shard over them), fewer ranks per node or train.cpu_offload=false")
    if cfg.launcher.force_memory:
        return msg + " (launcher.force_memory=true: starting anyway)"
    raise ConfigError("train.cpu_offload", msg, "launcher.force_memory=true to start anyway")
