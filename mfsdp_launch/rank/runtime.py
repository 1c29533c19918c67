"""Runtime assembly as named builders, called by the worker and by the GPU tests, so both run the
product's own wiring:

    init_runtime       process group, device, control group, mesh
    build_training     model (built, frozen, FP8-skipped), engine, optimizer, schedule
    build_checkpoints  the checkpoint manager (the worker resumes with it)
    build_io           metrics and the batch source, from the resumed position
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from ..components import float8, precision
from ..core.schema import Backend, CudaGraphMode
from ..engines import engine_caps, get_engine
from ..engines.base import Engine, apply_freeze
from ..core.errors import ConfigError
from ..core.fp8 import is_torchao, on_linears
from ..mesh import ParallelDims
from ..models import ModelSpec, build_model_spec, family, lora, qlora
from ..components.optim import build_optimizer, build_scheduler
from ..components.rng import seed_all


def dist_env() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun, or from SLURM under a bare srun."""
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        from ..core.rank_env import first_host, rendezvous_port

        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
        if "MASTER_ADDR" not in os.environ:
            os.environ["MASTER_ADDR"] = first_host(os.environ.get("SLURM_JOB_NODELIST", "localhost"))
            os.environ.setdefault("MASTER_PORT", str(rendezvous_port(os.environ.get("SLURM_JOB_ID", "0"))))
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


@dataclass
class Runtime:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    control: Any  # a CPU (gloo) group for control decisions: never syncs the GPU stream
    dims: ParallelDims
    mesh: Any  # None on Megatron-FSDP's own-mesh path (mesh.enabled=false)

    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank(self.rank)

    @property
    def cp_rank(self) -> int:
        return self.dims.coords(self.rank)["cp"]


def init_runtime(engine_cfg, mesh_cfg) -> Runtime:
    """Join the process group (torchrun's env), pick the device, build the mesh."""
    rank, local_rank, world_size = dist_env()
    cuda = torch.cuda.is_available() and engine_cfg.backend != Backend.gloo
    if engine_caps(engine_cfg.name).needs_cuda and not torch.cuda.is_available():
        raise ConfigError("engine", f"{engine_cfg.name} needs CUDA, and this torch build/machine has none", "fsdp2")
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = engine_cfg.backend.value if engine_cfg.backend else ("nccl" if cuda else "gloo")
    dist.init_process_group(backend=backend, timeout=timedelta(minutes=30),
                            device_id=device if cuda else None)
    control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    dims = ParallelDims.from_config(mesh_cfg, world_size)
    mesh = dims.build(device.type) if mesh_cfg.enabled else None
    return Runtime(rank, local_rank, world_size, device, control, dims, mesh)


@dataclass
class Training:
    spec: ModelSpec
    model: torch.nn.Module  # sharded
    forward_model: torch.nn.Module  # torch.compile'd when train.compile
    engine: Engine
    optimizer: torch.optim.Optimizer
    scheduler: Any
    fp8_recipe: Any
    frozen: List[str]
    fp8_kept: List[str]  # modules fp8.skip keeps in high precision
    peft_line: str = ""  # model.peft: what trains (printed at the start)
    compile_line: str = ""  # train.compile: what was compiled (printed at the start)

    def forward_context(self):
        return precision.fp8_autocast(self.fp8_recipe)


def build_model(model_cfg, fp8_cfg, seq_len: int, device: torch.device, fp8_recipe=None, tp: int = 1,
                fp8_all_gather: bool = True):
    """(spec, model, frozen names, fp8-skipped names): built on `device` (or meta), unsharded, with
    model.peft's adapters. `tp` reaches families whose layers are built tensor-parallel (te_gpt);
    `fp8_all_gather`: torchao_tensorwise's weights all-gather in FP8 (the engine's caps)."""
    spec = build_model_spec(model_cfg, seq_len, tp=tp)
    init_device = torch.device("meta") if model_cfg.init_on_meta else device
    with torch.device(init_device), precision.quantized_init(fp8_recipe if fp8_cfg.params else None):
        model = spec.build()
    frozen = apply_freeze(model, list(model_cfg.freeze))
    if lora.enabled(model_cfg):  # peft freezes the base: every parameter but the adapters
        spec.peft_line = lora.adapt(spec, model, model_cfg.peft)
        frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    if on_linears(fp8_cfg.recipe):  # FP8 on the plain Linears (torchao's or ours), no TE recipe
        kept = float8.convert(model, fp8_cfg, all_gather=fp8_all_gather)
    else:
        kept = precision.apply_fp8_skip(model, list(fp8_cfg.skip)) if fp8_recipe is not None and fp8_cfg.skip else []
    return spec, model, frozen, kept


def build_engine(cfg, rt: Runtime) -> Engine:
    # LoRA's frozen base is kept in the compute dtype: it never updates, so no main copy.
    frozen_dtype = precision.torch_dtype(cfg.precision.compute_dtype) if lora.enabled(cfg.model) else None
    return get_engine(cfg.engine.name, engine_cfg=cfg.engine, sharding_cfg=cfg.sharding,
                      precision_cfg=cfg.precision, dims=rt.dims, mesh=rt.mesh, device=rt.device,
                      cuda_graph=cfg.train.cuda_graph == CudaGraphMode.full_iteration, frozen_dtype=frozen_dtype,
                      cpu_offload=cfg.train.cpu_offload)


def build_training(cfg, rt: Runtime) -> Training:
    if rt.device.type == "cuda":
        precision.check_fp8_hardware(cfg.fp8)
    else:
        check_gpu_only(cfg)
    fp8_recipe = precision.build_fp8_recipe(cfg.fp8)
    seed_all(cfg.train.seed)  # the same on every rank: nothing is broadcast at wrap time
    fp8_all_gather = engine_caps(cfg.engine.name).torchao_fp8_all_gather
    spec, model, frozen, kept = build_model(cfg.model, cfg.fp8, cfg.train.seq_len, rt.device, fp8_recipe,
                                            tp=rt.dims.tp, fp8_all_gather=fp8_all_gather)
    engine = build_engine(cfg, rt)
    # The family's TP -> CP -> activation checkpointing on the built model; the engine shards last.
    family(cfg.model.name).parallelize(model, cfg.model, rt.dims, rt.mesh)
    model = engine.shard(model, spec, init_on_meta=cfg.model.init_on_meta)
    family(cfg.model.name).load_weights(cfg.model, model, engine)  # model.pretrained / model.init_from
    if qlora.enabled(cfg.model):  # the loaded base's linear layers (but lm_head) into NF4
        spec.peft_line += qlora.quantize_base(model)
    if cfg.train.compile:
        from ..models.activation_checkpoint import outermost_units
        from ..models.compile import compile_model

        # torchao's converted head, outside the blocks, is compiled on its own (float8.py says why)
        also = float8.outside(model, outermost_units(model, spec.unit_modules)) if is_torchao(cfg.fp8.recipe) else []
        forward_model, compile_line = compile_model(model, spec.unit_modules, also=also)
    else:
        forward_model, compile_line = model, ""
    decoupled = bool(cfg.engine.get("use_decoupled_grad", False))
    optimizer = engine.wrap_optimizer(model, build_optimizer(model, cfg.optim, fused_ok=rt.device.type == "cuda",
                                                             decoupled_grad=decoupled))
    if on_linears(cfg.fp8.recipe):
        float8.after_optimizer_steps(model, optimizer, cfg.fp8, all_gather=fp8_all_gather)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)  # after the engine patched step()
    return Training(spec, model, forward_model, engine, optimizer, scheduler, fp8_recipe, frozen, kept,
                    peft_line=spec.peft_line, compile_line=compile_line)


def check_gpu_only(cfg) -> None:
    """A run that lands on the CPU (no CUDA, or engine.backend=gloo) refuses the GPU-only tools in
    one line; the launcher refuses them first when it can tell (planner/machine.py)."""
    from ..planner.machine import refuse_gpu_only

    refuse_gpu_only(cfg, "this run is on the CPU")


def splits_sequence(cfg, rt: Runtime) -> bool:
    """mesh.cp > 1 with a family that splits each sequence over cp (the toys replicate over it)."""
    return rt.dims.cp > 1 and family(cfg.model.name).support(engine_caps(cfg.engine.name)).splits_sequence


def token_copies(cfg, rt: Runtime) -> int:
    """Ranks that read the same tokens: the world over the ranks of distinct data (dp, and cp
    where it splits the sequences), i.e. the tensor-parallel copies."""
    distinct = rt.dims.dp_size * (rt.dims.cp if splits_sequence(cfg, rt) else 1)
    return max(1, rt.world_size // distinct)


def _to_device(cfg, rt: Runtime, batch: dict) -> dict:
    """A batch on the device; under context parallelism this cp rank's part of each sequence
    (models/cp_layout.py). Every rank of a cp group reads the same samples (dp_rank excludes cp)."""
    if splits_sequence(cfg, rt):
        from ..models.cp_layout import shard_sequence

        batch = {k: shard_sequence(v, 1, rt.cp_rank, rt.dims.cp) for k, v in batch.items()}
    return copy_to_device(batch, rt.device)


def copy_to_device(batch: dict, device: torch.device) -> dict:
    """Host tensors queued onto the device behind the work in flight: on CUDA through pinned memory,
    since a copy from pageable memory may wait for the stream (CUDA stages it through the driver's
    buffer), which would empty the launch queue once a micro-batch."""
    if device.type != "cuda":
        return {k: v.to(device) for k, v in batch.items()}
    return {k: (v.pin_memory() if v.device.type == "cpu" else v).to(device, non_blocking=True)
            for k, v in batch.items()}


@dataclass
class IO:
    metrics: Any
    next_batch: Callable[[int, int], dict]  # (step, micro) -> this rank's batch on the device


def build_checkpoints(cfg, rt: Runtime, engine: Engine):
    from ..checkpoint import CheckpointManager, manifest_info_from_config

    # run.dir: a directory, or an object store's URL (core/storage.py)
    return CheckpointManager(cfg.checkpoint, cfg.run.dir, rank=rt.rank, world_size=rt.world_size,
                             engine=engine, process_group=rt.control,
                             manifest_info=manifest_info_from_config(cfg, world_size=rt.world_size))


def build_io(cfg, rt: Runtime, tr: Training, resumed) -> IO:
    """`resumed` is the TrainState after the checkpoint resume (data continues from its samples)."""
    from ..components.metrics import MetricsWriter

    from ..core.storage import local_run_dir

    next_batch = batch_source(cfg, tr.spec, rt, resumed)
    metrics = MetricsWriter(cfg.run.dir, enabled=rt.rank == 0, tensorboard=cfg.logging.tensorboard,
                            logging_cfg=cfg.logging, local_dir=local_run_dir(cfg.run),
                            data_tokens=getattr(next_batch, "data_tokens", None),
                            start_step=resumed.step)
    return IO(metrics=metrics, next_batch=next_batch)


def batch_source(cfg, spec: ModelSpec, rt: Runtime, resumed=None) -> Callable[[int, int], dict]:
    """(step, micro) -> this rank's batch on the device; deterministic in (seed, step, DP rank).

    Positions count from the samples consumed at the resumed step, so a resume that changes the
    global batch (another DP size) continues with the next unseen sample.
    """
    device = rt.device
    if spec.uses_tokens:
        from ..data import TokenBatches

        t = cfg.train
        batches = TokenBatches(cfg.data, seq_len=t.seq_len, micro_batch_size=t.micro_batch_size,
                               vocab_size=spec.vocab_size, seed=t.seed, dp_rank=rt.dp_rank, dp_size=rt.dims.dp_size)
        base = {"base_step": resumed.step, "base_samples": resumed.consumed_samples} if resumed else {}

        def next_batch(step: int, micro: int) -> dict:
            return _to_device(cfg, rt, batches.microbatch(step, micro, grad_accum_steps=t.grad_accum_steps, **base))

        next_batch.data_tokens = batches.n_tokens or None  # the train split's size (metrics' epochs)
        next_batch.masked_labels = batches.masked_labels  # a loss mask: per-token weights (rank/token_weights.py)
        return next_batch
    # The seed's toys train on one fixed (input, target) pair per data-parallel rank.
    gen = torch.Generator().manual_seed(cfg.train.seed * 1000003 + rt.dp_rank)
    fixed = {k: v.to(device) for k, v in spec.synthetic_batch(gen, cfg.train.micro_batch_size,
                                                              torch.device("cpu")).items()}
    return lambda step, micro: fixed


def val_batch_source(cfg, spec: ModelSpec, rt: Runtime) -> Optional[Callable[[int], dict]]:
    """val_step -> this rank's validation batch on the device; None when the data holds none out.

    The same val samples every time (layout.val_batch_start), split over the DP ranks.
    """
    from ..data import TokenBatches, has_validation, val_batch_start

    if not spec.uses_tokens or not has_validation(cfg.data):
        return None
    t = cfg.train
    batches = TokenBatches(cfg.data, seq_len=t.seq_len, micro_batch_size=t.micro_batch_size, vocab_size=spec.vocab_size,
                           seed=t.seed, dp_rank=rt.dp_rank, dp_size=rt.dims.dp_size, split="val")

    def val_batch(val_step: int) -> dict:
        return _to_device(cfg, rt, batches.batch(val_batch_start(val_step, micro_batch_size=t.micro_batch_size,
                                                                 dp_rank=rt.dp_rank, dp_size=rt.dims.dp_size)))

    return val_batch


def full_iteration_graph(cfg, tr: Training, next_batch, start_step: int, control) -> Optional[Callable]:
    if cfg.train.cuda_graph != CudaGraphMode.full_iteration:
        return None
    from ..components.cuda_graph import FullIterationCudaGraph

    return FullIterationCudaGraph(tr.forward_model, tr.spec.loss, tr.optimizer, next_batch,
                                  forward_context=tr.forward_context, start_step=start_step, process_group=control)
