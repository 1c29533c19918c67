"""The train loop: microbatches with gradient sync only on the last one, clipping, the optimizer
step, validation, metrics at log steps, checkpoints and graceful stops."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .oom import note_step
from ..components.metrics import MetricsWriter, StepTimer, alloc_retries, peak_memory_gib, peak_reserved_gib


@dataclass
class TrainState:
    step: int = 0  # optimizer steps completed
    tokens_seen: int = 0
    consumed_samples: int = 0

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, d: dict) -> None:
        self.step = int(d["step"])
        self.tokens_seen = int(d["tokens_seen"])
        self.consumed_samples = int(d["consumed_samples"])


@dataclass
class LoopContext:
    """What the loop needs besides the model: everything already built by the worker."""

    engine: object
    spec: object
    optimizer: torch.optim.Optimizer
    scheduler: object
    next_batch: Callable[[int, int], dict]  # (step, micro) -> batch on the device
    forward_context: Callable[[], object]  # e.g. TE's FP8 autocast
    device: torch.device
    world_size: int
    dp_size: int
    rank: int
    peak_tflops: Optional[float]
    metrics: MetricsWriter
    checkpoints: object  # CheckpointManager
    stop_requested: Callable[[int], bool]  # collective: every rank gets the same answer
    step_fn: Optional[Callable[[], torch.Tensor]] = None  # a captured CUDA graph replay, if any
    val_batch: Optional[Callable[[int], dict]] = None  # val step -> this rank's validation batch; None: no validation
    profiler: Optional[object] = None  # profiling.StepProfiler (train.profile), or None


def train(model: torch.nn.Module, train_cfg, state: TrainState, ctx: LoopContext) -> TrainState:
    ga = train_cfg.grad_accum_steps
    sync_every = bool(ctx.engine.engine_cfg.sync_every_microbatch)
    samples_per_step = train_cfg.micro_batch_size * ga * ctx.dp_size
    tokens_per_step = samples_per_step * ctx.spec.tokens_per_sample
    progress = _Progress(train_cfg, state.step) if ctx.rank == 0 else None
    timer = StepTimer(ctx.device)
    loss_sum = torch.zeros((), device=ctx.device, dtype=torch.float32)
    steps_since_log, blocked, paused = 0, 0.0, 0.0
    try:
        while state.step < train_cfg.steps:
            if ctx.profiler is not None:
                ctx.profiler.begin(state.step + 1)
            for micro in range(ga):
                ctx.engine.set_grad_sync(model, sync_every or micro == ga - 1)
                if ctx.step_fn is not None:
                    loss = ctx.step_fn()
                else:
                    batch = ctx.next_batch(state.step, micro)
                    with ctx.forward_context():
                        loss = ctx.spec.loss(model, batch)
                    (loss / ga).backward()
                loss_sum += loss.detach().float() / ga
            grad_norm = ctx.engine.clip_grad_norm(model, train_cfg.grad_clip)
            ctx.optimizer.step()
            ctx.scheduler.step()
            ctx.optimizer.zero_grad(set_to_none=ctx.step_fn is None)
            state.step += 1
            if ctx.profiler is not None:
                ctx.profiler.end(state.step)
            state.consumed_samples += samples_per_step
            state.tokens_seen += tokens_per_step
            steps_since_log += 1

            stop = ctx.stop_requested(state.step)
            last = state.step == train_cfg.steps
            val_row = None
            if _validation_due(ctx, train_cfg, state.step, last, stop):
                val_row, seconds = validate(model, train_cfg.val_steps, state.step, ctx, progress)
                paused += seconds
            if state.step % train_cfg.log_interval == 0 or last or stop:
                dt = (timer.lap() - paused) / steps_since_log  # validation is not training time
                row = _log_row(ctx, state, loss_sum / steps_since_log, grad_norm, dt, tokens_per_step, blocked)
                loss_sum.zero_()
                steps_since_log, blocked, paused = 0, 0.0, 0.0
                if progress is not None:
                    progress.log(row)
                ctx.metrics.write({**row, **(val_row or {})})  # one row per step
                if not math.isfinite(row["loss"]):
                    raise FloatingPointError(f"loss is {row['loss']} at step {state.step}")
            elif val_row is not None:
                ctx.metrics.write(val_row)
            if progress is not None:
                progress.advance(state.step)
            blocked += ctx.checkpoints.maybe_save(state.step, model, ctx.optimizer, ctx.scheduler, state,
                                                  final=last, force=stop)
            if stop and not last:
                if ctx.rank == 0:
                    print(f"stopping at step {state.step} on request; checkpoint saved", flush=True)
                break
    except Exception as exc:
        note_step(exc, state.step + 1)  # the step it escaped from, for the one-line OOM report (rank/oom.py)
        raise
    finally:
        if progress is not None:
            progress.close()
        if ctx.profiler is not None:
            ctx.profiler.close()
    return state


def _validation_due(ctx: LoopContext, train_cfg, step: int, last: bool, stop: bool) -> bool:
    """Every train.val_interval steps and after the last one; not when stopping early (preemption)."""
    if ctx.val_batch is None or (stop and not last):
        return False
    return last or (train_cfg.val_interval > 0 and step % train_cfg.val_interval == 0)


def validate(model: torch.nn.Module, val_steps: int, step: int, ctx: LoopContext, progress=None):
    """Mean loss over `val_steps` validation batches of every rank: ({"step", "val_loss", "val_ppl"},
    seconds taken). No gradients, no optimizer or RNG use: the training that follows is the same
    as without it. The loop writes the row, merged into the step's training row if it has one."""
    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    total = torch.zeros((), device=ctx.device, dtype=torch.float32)
    try:
        with torch.no_grad():
            for i in range(val_steps):
                batch = ctx.val_batch(i)
                with ctx.forward_context():
                    total += ctx.spec.loss(model, batch).detach().float()
    finally:
        model.train(was_training)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)  # every rank's batches weigh the same
    loss = total.item() / (val_steps * ctx.world_size)
    row = {"step": step, "val_loss": loss, "val_ppl": math.exp(loss) if loss < 700 else float("inf")}
    seconds = time.perf_counter() - t0
    if progress is not None:
        progress.log_val(row, seconds)
    return row, seconds


def _log_row(ctx: LoopContext, state: TrainState, loss: torch.Tensor, grad_norm, dt: float,
             tokens_per_step: int, blocked: float) -> dict:
    loss = loss.detach().clone()
    # Every rank holds its own DP shard's loss; the logged loss is their mean.
    dist.all_reduce(loss, op=dist.ReduceOp.SUM)
    loss = loss.item() / ctx.world_size
    tokens_per_s_per_gpu = tokens_per_step / dt / ctx.world_size
    tflops = ctx.spec.flops_per_token * tokens_per_s_per_gpu / 1e12 if ctx.spec.flops_per_token else None
    mfu = tflops / ctx.peak_tflops if (tflops is not None and ctx.peak_tflops) else None
    return {
        "step": state.step,
        "loss": loss,
        # A device tensor under full-iteration CUDA graphs (capturable FusedAdam).
        "lr": float(ctx.optimizer.param_groups[0]["lr"]),
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "tokens_per_s_per_gpu": tokens_per_s_per_gpu,
        "tflops_per_gpu": tflops,
        "mfu": mfu,
        "peak_mem_gib": peak_memory_gib(ctx.device),
        "peak_reserved_gib": peak_reserved_gib(ctx.device),
        "alloc_retries": alloc_retries(ctx.device),
        "step_time_s": dt,
        "tokens_seen": state.tokens_seen,
        "ckpt_blocked_s": blocked,
    }


class _Progress:
    """A rich progress bar on a terminal; plain log lines always (also when piped)."""

    def __init__(self, train_cfg, start: int):
        from rich.console import Console

        self.console = Console(highlight=False, file=sys.stdout, soft_wrap=True)
        self.bar = None
        if train_cfg.progress and self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                console=self.console, transient=True)
            self.task = self.bar.add_task("train", total=train_cfg.steps, completed=start)
            self.bar.start()

    def log(self, row: dict) -> None:
        mfu = f"{100 * row['mfu']:.1f}%" if row["mfu"] is not None else "n/a"
        tf = f"{row['tflops_per_gpu']:.2f}" if row["tflops_per_gpu"] is not None else "n/a"
        line = (f"step {row['step']:>6}  loss {row['loss']:.4f}  lr {row['lr']:.2e}  "
                f"gnorm {row['grad_norm']:.3f}  tok/s/gpu {row['tokens_per_s_per_gpu']:,.0f}  "
                f"TFLOP/s/gpu {tf}  MFU {mfu}  mem {row['peak_mem_gib']:.2f} GiB  "
                f"{row['step_time_s'] * 1000:.0f} ms/step")
        (self.bar.console if self.bar else self.console).print(line)
        sys.stdout.flush()

    def log_val(self, row: dict, seconds: float) -> None:
        line = f"step {row['step']:>6}  val_loss {row['val_loss']:.4f}  val_ppl {row['val_ppl']:.2f}  ({seconds:.1f} s)"
        (self.bar.console if self.bar else self.console).print(line)
        sys.stdout.flush()

    def advance(self, step: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
