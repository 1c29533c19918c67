"""One rank of a training job. The only module that knows every other one: it wires the frozen
config into the process group, mesh, model, engine, optimizer, data, checkpoints and loop.

Started by torchrun as `python -m mfsdp_launch.worker --config RUN_DIR/config.yaml`.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from datetime import timedelta
from pathlib import Path
from typing import List, NoReturn, Optional

from .errors import ConfigError


def _dist_env() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun, or from SLURM under a bare srun."""
    if "RANK" not in os.environ and "SLURM_PROCID" in os.environ:
        os.environ["RANK"] = os.environ["SLURM_PROCID"]
        os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
        os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
        if "MASTER_ADDR" not in os.environ:
            nodes = os.environ.get("SLURM_JOB_NODELIST", "localhost")
            os.environ["MASTER_ADDR"] = _first_slurm_host(nodes)
            os.environ.setdefault("MASTER_PORT", str(20000 + int(os.environ.get("SLURM_JOB_ID", "0")) % 20000))
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM nodelist like 'gpu[003-004,007],cpu01'."""
    head = nodelist.split(",")[0]
    if "[" in head:
        prefix, rest = head.split("[", 1)
        first = rest.rstrip("]").split(",")[0].split("-")[0]
        return prefix + first
    return head


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mfsdp_launch.worker")
    parser.add_argument("--config", required=True, help="the frozen config.yaml written by the launcher")
    args = parser.parse_args(argv)
    from .compose import load_frozen

    try:
        cfg = load_frozen(args.config)
    except ConfigError as exc:
        print(f"mfsdp-train: error: {exc}", file=sys.stderr)
        return 2
    return run(cfg)


def run_as_external_worker(cfg, overrides: List[str]) -> int:
    """Under a torchrun/srun we did not start: every rank composed the same config; rank 0 freezes it."""
    from .compose import save_frozen
    from .validate import validate

    rank, _, world_size = _dist_env()
    # The job's shape is whatever torchrun/srun started, not what the config guessed.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", world_size)))
    cfg.launcher.nproc_per_node, cfg.launcher.nnodes = local, max(1, world_size // local)
    cfg.launcher.node_rank = rank // local
    validate(cfg, check_hardware=False)
    run_dir = Path(cfg.run.dir).expanduser().resolve()
    cfg.run.dir = str(run_dir)
    if rank == 0:
        save_frozen(cfg, run_dir, overrides)
    return run(cfg)


def run(cfg) -> int:
    rank, _, _ = _dist_env()
    try:
        code = _train(cfg)
    except ConfigError as exc:  # raised the same on every rank
        if rank == 0:
            print(f"mfsdp-train: error: {exc}", file=sys.stderr, flush=True)
        code = 2
    except Exception:  # noqa: BLE001 - reported, then the rank leaves at once
        _leave_after_failure(rank)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return code


def _leave_after_failure(rank: int) -> NoReturn:
    """Print why this rank failed and exit without tearing the process groups down.

    NCCL's teardown waits for the peers, and for every live CUDA graph that uses a communicator
    (the traceback keeps the captured graph alive): a failed rank would hang there silently while
    its peers wait for it, and torchrun would never see it fail and stop the job.
    """
    import traceback

    sys.stdout.flush()
    print(f"mfsdp-train: rank {rank} failed:", file=sys.stderr)
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)


def _init_distributed(engine_cfg, local_rank: int):
    import torch
    import torch.distributed as dist

    use_cuda = torch.cuda.is_available() and engine_cfg.backend != "gloo"
    if engine_cfg.name == "megatron_fsdp" and not torch.cuda.is_available():
        raise ConfigError("engine", "megatron_fsdp needs CUDA, and this torch build/machine has none", "fsdp2")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    backend = engine_cfg.backend or ("nccl" if use_cuda else "gloo")
    dist.init_process_group(backend=backend, timeout=timedelta(minutes=30),
                            device_id=device if device.type == "cuda" else None)
    # A CPU-side group for control decisions (stop requests, checkpoint barriers): it never
    # synchronizes the GPU stream.
    control = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
    return device, control


def _train(cfg) -> int:
    import numpy as np
    import torch
    import torch.distributed as dist
    from . import precision
    from .checkpoint import CheckpointManager, manifest_info_from_config
    from .engines import get_engine
    from .engines.base import apply_freeze
    from . import rundir
    from .loop import LoopContext, TrainState, train
    from .mesh import ParallelDims
    from .metrics import MetricsWriter, device_peak_tflops
    from .models import build_model_spec
    from .optim import build_optimizer, build_scheduler
    from .watchdog import StallWatchdog

    rank, local_rank, world_size = _dist_env()
    watchdog = StallWatchdog(cfg.train.stall_dump_s, label=f"rank {rank}: ")
    watchdog.start()  # covers start-up too (sharding, resume, the first step's capture or compile)
    device, control = _init_distributed(cfg.engine, local_rank)
    run_dir = Path(cfg.run.dir)
    dims = ParallelDims.from_config(cfg.mesh, world_size)
    mesh = dims.build(device.type) if cfg.mesh.enabled else None
    if device.type == "cuda":
        precision.check_fp8_hardware(cfg.fp8)
    fp8_recipe = precision.build_fp8_recipe(cfg.fp8)

    # Same seed on every rank before building: nothing is broadcast at wrap time.
    seed = cfg.train.seed
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
    spec = build_model_spec(cfg.model, cfg.train.seq_len)
    init_device = torch.device("meta") if cfg.model.init_on_meta else device
    with torch.device(init_device), precision.quantized_init(fp8_recipe if cfg.fp8.params else None):
        model = spec.build()
    frozen = apply_freeze(model, list(cfg.model.freeze))
    if fp8_recipe is not None and cfg.fp8.skip:
        kept = precision.apply_fp8_skip(model, list(cfg.fp8.skip))
        if rank == 0:
            print(f"fp8.skip: {len(kept)} module(s) stay in {cfg.precision.compute_dtype}: {', '.join(kept[:4])}"
                  f"{' ...' if len(kept) > 4 else ''}", flush=True)

    engine = get_engine(cfg.engine.name, engine_cfg=cfg.engine, sharding_cfg=cfg.sharding,
                        precision_cfg=cfg.precision, dims=dims, mesh=mesh, device=device,
                        cuda_graph=cfg.train.cuda_graph == "full_iteration")
    model = engine.shard(model, spec, init_on_meta=cfg.model.init_on_meta)
    forward_model = torch.compile(model) if cfg.train.compile else model
    optimizer = build_optimizer(model, cfg.optim, fused_ok=device.type == "cuda")
    optimizer = engine.wrap_optimizer(model, optimizer)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.steps)  # after the engine patched step()

    manifest_info = manifest_info_from_config(cfg, world_size=world_size)
    checkpoints = CheckpointManager(cfg.checkpoint, run_dir, manifest_info=manifest_info, rank=rank,
                                    world_size=world_size, engine=engine, process_group=control)
    state = TrainState()
    checkpoints.resume(model, optimizer, scheduler, state)

    dp_rank = dims.dp_rank(rank)
    next_batch = _batch_source(cfg, spec, dims, dp_rank, device, resumed=state)
    peak, peak_source = device_peak_tflops(device, cfg.train.peak_tflops)
    if rank == 0:
        print(f"model {cfg.model.name}: {spec.num_params / 1e6:,.2f}M params"
              f"{f' ({len(frozen)} frozen tensors)' if frozen else ''}; engine {engine.name}; "
              f"mesh {dims.shape}; device {device.type}; "
              f"{f'MFU against {peak:.0f} TFLOP/s ({peak_source})' if peak else f'MFU null ({peak_source})'}",
              flush=True)
    metrics = MetricsWriter(run_dir, enabled=rank == 0, tensorboard=cfg.logging.tensorboard,
                            start_step=state.step)

    stop_file = run_dir / rundir.STOP
    flag = torch.zeros(1, dtype=torch.int32)
    got_signal = {"value": False}
    _install_stop_signals(got_signal)

    def stop_requested(step: int) -> bool:
        watchdog.arm()  # called once per completed step
        flag.fill_(int(got_signal["value"] or (rank == 0 and stop_file.exists())))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control)
        return bool(flag.item())

    ctx = LoopContext(
        engine=engine, spec=spec, optimizer=optimizer, scheduler=scheduler, next_batch=next_batch,
        forward_context=lambda: precision.fp8_autocast(fp8_recipe), device=device,
        world_size=world_size, dp_size=dims.dp_size, rank=rank, peak_tflops=peak, metrics=metrics,
        checkpoints=checkpoints, stop_requested=stop_requested,
    )
    if cfg.train.cuda_graph == "full_iteration":
        from .cuda_graph import FullIterationCudaGraph

        ctx.step_fn = FullIterationCudaGraph(forward_model, spec.loss, optimizer, next_batch,
                                             forward_context=ctx.forward_context, start_step=state.step,
                                             process_group=control)
    try:
        train(forward_model, cfg.train, state, ctx)
        checkpoints.wait()
        if ctx.step_fn is not None:
            ctx.step_fn.release()  # (on failure the rank exits without NCCL teardown: see run)
    finally:
        metrics.close()
        watchdog.stop()
    if rank == 0:
        stop_file.unlink(missing_ok=True)
    # Leave together: a rank that tears its process groups down while another still talks to it
    # can abort in C++ at exit.
    dist.barrier(group=control)
    return 0


def _install_stop_signals(flag: dict) -> None:
    """SIGTERM/SIGINT sent straight to a worker (SLURM preemption) also ask for a graceful stop."""
    import signal

    def handler(signum, _frame):
        flag["value"] = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def _batch_source(cfg, spec, dims, dp_rank: int, device, resumed=None):
    """(step, micro) -> this rank's batch on the device; deterministic in (seed, step, DP rank).

    Positions count from the samples consumed at the resumed step (`resumed`, a TrainState), so a
    resume that changes the global batch (another DP size) continues with the next unseen sample.
    """
    import torch

    if spec.uses_tokens:
        from .data import TokenBatches

        batches = TokenBatches(cfg.data, seq_len=cfg.train.seq_len, micro_batch_size=cfg.train.micro_batch_size,
                               vocab_size=spec_vocab(cfg), seed=cfg.train.seed, dp_rank=dp_rank,
                               dp_size=dims.dp_size)
        ga = cfg.train.grad_accum_steps
        base = {"base_step": resumed.step, "base_samples": resumed.consumed_samples} if resumed else {}

        def next_batch(step: int, micro: int) -> dict:
            b = batches.microbatch(step, micro, grad_accum_steps=ga, **base)
            return {k: v.to(device, non_blocking=True) for k, v in b.items()}

        return next_batch

    # The seed's toys train on one fixed (input, target) pair per data-parallel rank.
    gen = torch.Generator().manual_seed(cfg.train.seed * 1000003 + dp_rank)
    fixed = {k: v.to(device) for k, v in spec.synthetic_batch(gen, cfg.train.micro_batch_size,
                                                              torch.device("cpu")).items()}
    return lambda step, micro: fixed


def spec_vocab(cfg) -> int:
    from .models import sizes

    return sizes.resolve_gpt_dims(cfg.model).vocab_size


if __name__ == "__main__":
    sys.exit(main())
