"""One rank of a training job: the module that wires config -> mesh -> engine -> loop -> checkpoint,
through the builders in rank/runtime.py.

Started on every rank by `python -m mfsdp_launch.rank --config RUN_DIR/config.yaml` (rank.py).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import List, NoReturn, Optional

from ..core.console import eprint
from ..core.errors import ConfigError


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mfsdp_launch.rank.worker")
    parser.add_argument("--config", required=True, help="the frozen config.yaml written by the launcher")
    args = parser.parse_args(argv)
    from ..planner.compose import load_frozen

    try:
        cfg = load_frozen(args.config)
    except ConfigError as exc:
        eprint(f"mfsdp-train: error: {exc}")
        return 2
    return run(cfg)


def run_as_external_worker(cfg, overrides: List[str]) -> int:
    """Under a torchrun/srun we did not start: every rank composed the same config; rank 0 freezes it."""
    from ..planner.compose import save_frozen
    from ..planner.resolve import resolve
    from ..planner.validate import validate
    from .runtime import dist_env

    from ..core import storage

    if storage.is_remote(cfg.run.dir):
        raise ConfigError("run.dir", f"{cfg.run.dir}: an object-store run.dir needs the launcher (mfsdp-train "
                          "without a torchrun around it)", "a directory, or mfsdp-train run.dir=... alone")
    rank, _, world_size = dist_env()
    # The job's shape is whatever torchrun/srun started, not what the config guessed.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", world_size)))
    cfg.launcher.nproc_per_node, cfg.launcher.nnodes = local, max(1, world_size // local)
    cfg.launcher.node_rank = rank // local
    validate(cfg, resolve(cfg), check_hardware=False)
    run_dir = Path(cfg.run.dir).expanduser().resolve()
    cfg.run.dir = str(run_dir)
    if rank == 0:
        from ..checkpoint.aside import before_start

        try:  # what the launcher does before spawning: keep what this run would replace
            moved = before_start(cfg.checkpoint, run_dir)
        except ConfigError:  # refused: rank 0's CheckpointManager says so on every rank, in one line
            pass
        else:
            if moved:
                print(moved, flush=True)
            save_frozen(cfg, run_dir, overrides)
    return run(cfg)


def run(cfg) -> int:
    import gc

    from .runtime import dist_env

    # Torch's modules are imported by now: freezing their objects keeps every later collection
    # (and the one at the end) from walking them again, a few tenths of a second a rank.
    gc.freeze()

    from ..checkpoint import CheckpointError
    from ..core import exit_codes
    from .step_guard import Diverged

    rank = dist_env()[0]
    try:
        code = _train(cfg)
    except ConfigError as exc:  # raised the same on every rank
        if rank == 0:
            eprint(f"mfsdp-train: error: {exc}")
        code = 2
    except Diverged as exc:  # decided alike on every rank (one all-reduce a step)
        if rank == 0:
            eprint(f"mfsdp-train: error: training diverged at {exc}")
        code = exit_codes.DIVERGED
    except CheckpointError as exc:  # every rank raises it together, after agreeing on the failure
        if rank == 0:
            eprint(f"mfsdp-train: error: {exc}")
        code = 1
    except Exception as exc:  # noqa: BLE001 - reported, then the rank leaves at once
        _leave_after_failure(rank, exc, cfg)
    import torch.distributed as dist

    # Collect the run's objects (FSDP modules hold reference cycles) while their process groups
    # still exist: destroyed later, at interpreter exit, a gloo group can abort the process.
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()
    return code


def _leave_after_failure(rank: int, exc: BaseException, cfg) -> NoReturn:
    """Print why this rank failed and exit without tearing the process groups down.

    NCCL's teardown waits for the peers, and for every live CUDA graph that uses a communicator
    (the traceback keeps the captured graph alive): a failed rank would hang there silently while
    its peers wait for it, and torchrun would never see it fail and stop the job.
    Out of GPU memory, the block starts with rank/oom.py's one line, which is all the console shows.
    """
    import traceback

    from . import oom

    sys.stdout.flush()
    if oom.is_oom(exc):
        print(oom.oom_line(exc, rank, oom.estimate_gib(cfg)), file=sys.stderr)
    else:
        print(f"mfsdp-train: rank {rank} failed:", file=sys.stderr)
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)


def _train(cfg) -> int:
    import torch.distributed as dist

    from ..core import rundir
    from ..core.storage import local_run_dir
    from .loop import LoopContext, TrainState, train
    from ..components import float8
    from ..components.metrics import device_peaks
    from ..core.mfu import precision_peak, start_line
    from ..components.profiling import build_profiler
    from .runtime import (build_checkpoints, build_io, build_training, dist_env, full_iteration_graph, init_runtime,
                          token_copies, val_batch_source)
    from . import straggler
    from .stopping import StopControl
    from .watchdog import StallWatchdog

    watchdog = StallWatchdog(cfg.train.stall_dump_s, label=f"rank {dist_env()[0]}: ")
    watchdog.start()  # covers start-up too (sharding, resume, the first step's capture or compile)
    rt = init_runtime(cfg.engine, cfg.mesh)
    tr = build_training(cfg, rt)
    checkpoints = build_checkpoints(cfg, rt, tr.engine)
    state = TrainState()
    checkpoints.resume(tr.model, tr.optimizer, tr.scheduler, state)
    io = build_io(cfg, rt, tr, resumed=state)
    peaks, share = device_peaks(rt.device, cfg.train.peak_tflops), fp8_flops_share(cfg, tr.model)
    if rt.rank == 0:
        _print_start(cfg, rt, tr, start_line(peaks, share))
    # The STOP file, or SIGTERM/SIGINT/SIGHUP/SIGUSR1 sent straight to a rank (SLURM preemption):
    # every rank checkpoints and stops at the same step.
    local = local_run_dir(cfg.run)  # run.dir, or this machine's side of an object-store run.dir
    stop = StopControl(local, rt.rank, rt.control).install()

    def stop_requested(step: int) -> bool:
        watchdog.arm()  # called once per completed step
        # The per-step stop collective also carries rank 0's checkpoint.interval_minutes clock.
        stopping = stop.requested(step, vote=checkpoints.time_due())
        checkpoints.agree(step, stop.voted)
        return stopping

    ctx = LoopContext(
        engine=tr.engine, spec=tr.spec, optimizer=tr.optimizer, scheduler=tr.scheduler, next_batch=io.next_batch,
        forward_context=tr.forward_context, device=rt.device, world_size=rt.world_size, dp_size=rt.dims.dp_size,
        rank=rt.rank, peak_tflops=peaks.bf16, precision_peak_tflops=precision_peak(peaks, share),
        metrics=io.metrics, checkpoints=checkpoints, stop_requested=stop_requested,
        step_fn=full_iteration_graph(cfg, tr, io.next_batch, state.step, rt.control),
        val_batch=val_batch_source(cfg, tr.spec, rt),
        profiler=build_profiler(cfg.train, str(local), rt.rank, rt.device),
        progress_file=local / rundir.PROGRESS,
        stragglers=straggler.build(cfg.train, rt.world_size, rt.device, rt.control),
        masked_labels=bool(getattr(io.next_batch, "masked_labels", False)),
        token_copies=token_copies(cfg, rt),
        before_micro_batch=float8.micro_batch_hook(cfg.fp8),
    )
    try:
        train(tr.forward_model, cfg.train, state, ctx)
        checkpoints.wait()
        if ctx.step_fn is not None:
            ctx.step_fn.release()  # (on failure the rank exits without NCCL teardown: see run)
    finally:
        io.metrics.close()
        watchdog.stop()
    if rt.rank == 0:
        (local / rundir.STOP).unlink(missing_ok=True)
    # Leave together: a rank that tears its process groups down while another still talks to it
    # can abort in C++ at exit.
    dist.barrier(group=rt.control)
    return 0


def _print_start(cfg, rt, tr, mfu: str) -> None:
    if tr.fp8_kept:
        kept = tr.fp8_kept
        print(f"fp8.skip: {len(kept)} module(s) stay in {cfg.precision.compute_dtype}: {', '.join(kept[:4])}"
              f"{' ...' if len(kept) > 4 else ''}", flush=True)
    for line in (tr.peft_line, tr.compile_line):
        if line:
            print(line, flush=True)
    frozen = f" ({len(tr.frozen)} frozen tensors)" if tr.frozen else ""
    print(f"model {cfg.model.name}: {tr.spec.num_params / 1e6:,.2f}M params{frozen}; engine {tr.engine.name}; "
          f"mesh {rt.dims.shape}; device {rt.device.type}; {mfu}", flush=True)


def fp8_flops_share(cfg, model):
    """The FP8 GEMMs' share of a token's FLOPs (core/fp8_flops.py): from the family's matmuls, or
    from the built model's nn.Linear layers where the family measures rather than derives them."""
    from ..core.fp8_flops import fp8_share
    from ..models import family
    from ..models.lora import module_table

    fam = family(cfg.model.name)
    matmuls = fam.matmuls(cfg.model, cfg.train.seq_len)
    if matmuls is None and str(cfg.fp8.recipe) != "none":
        linears = {name: io for name, io in module_table(model).items() if io}
        matmuls = fam.matmuls(cfg.model, cfg.train.seq_len, linears=linears)
    return fp8_share(matmuls, cfg.fp8)


def leave(exit_code: int) -> NoReturn:
    """Exit without interpreter teardown: the process groups are destroyed and every file closed
    by now, and C++ destructors of gloo's threads at exit have aborted a rank ("terminate called
    without an active exception") after a run that had finished."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


if __name__ == "__main__":
    leave(main())
