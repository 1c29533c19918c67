"""The train loop: microbatches with gradient sync only on the last one, clipping, the optimizer
step, validation, metrics at log steps, checkpoints and graceful stops."""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .oom import note_step
from .progress import RankProgress
from .step_guard import OK, ROLLBACK, Diverged, StepGuard
from .token_weights import distinct_targets, step_weights, target_count, weighted_mean
from ..components.optim import arm_device_step, skips_on_device
from ..components.metrics import (MetricsWriter, StepTimer, alloc_retries, host_values, peak_memory_gib,
                                  peak_reserved_gib)
from ..core.mfu import mfu


@dataclass
class TrainState:
    step: int = 0  # steps completed (skipped bad steps included: the data moved past them)
    tokens_seen: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0  # bad steps skipped, over the whole run (rank/step_guard.py)
    rollbacks: int = 0  # rollbacks to a checkpoint after train.max_bad_steps bad steps in a row
    lr_scale: float = 1.0  # train.rollback_lr_scale ** rollbacks

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, d: dict) -> None:
        self.step = int(d["step"])
        self.tokens_seen = int(d["tokens_seen"])
        self.consumed_samples = int(d["consumed_samples"])
        # Checkpoints written before bad steps were counted have none of these.
        self.skipped_steps = int(d.get("skipped_steps", 0))
        self.rollbacks = int(d.get("rollbacks", 0))
        self.lr_scale = float(d.get("lr_scale", 1.0))


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
    peak_tflops: Optional[float]  # the dense bf16 peak: `mfu` (core/mfu.py)
    metrics: MetricsWriter
    checkpoints: object  # CheckpointManager
    stop_requested: Callable[[int], bool]  # collective: every rank gets the same answer
    step_fn: Optional[Callable[[], torch.Tensor]] = None  # a captured CUDA graph replay, if any
    val_batch: Optional[Callable[[int], dict]] = None  # val step -> this rank's validation batch; None: no validation
    profiler: Optional[object] = None  # profiling.StepProfiler (train.profile), or None
    progress_file: Optional[Path] = None  # rank 0's position, for the launcher's bar (rank/progress.py)
    stragglers: Optional[object] = None  # straggler.StragglerReport (train.straggler_ratio), or None
    # Labels may hold -100 (a loss mask): micro-batches are weighed by their target tokens
    # (rank/token_weights.py); False: every micro-batch holds mbs * seq_len targets.
    masked_labels: bool = False
    token_copies: int = 1  # ranks reading the same tokens (tp): the global target count divides by it
    precision_peak_tflops: Optional[float] = None  # the FP8-weighted peak: `mfu_at_precision` (core/mfu.py)
    # Called with each micro-batch's index before it runs (fp8.cache_weight_casts: the first of a
    # step writes the weight casts, the others read them).
    before_micro_batch: Optional[Callable[[int], None]] = None


@dataclass
class _Window:
    """What the next metrics row sums since the last one."""

    loss_sum: float = 0.0  # the losses of the applied steps
    good: int = 0  # applied steps
    steps: int = 0  # steps (skipped ones included)
    blocked: float = 0.0  # seconds checkpoint saves blocked training
    paused: float = 0.0  # seconds of validation
    targets: Optional[torch.Tensor] = None  # masked labels: the global target tokens (device)


def defers_verdict(ctx: LoopContext, train_cfg) -> bool:
    """Whether a step's verdict (rank/step_guard.py) is read one step late, so that the host never
    waits for the device before the optimizer step and the next forward (a forward whose kernels
    launch slower than they run would otherwise leave the GPU idle every step): when the optimizer
    skips a bad step on the device by itself, and nothing must act on the verdict before the next
    step: no spike judging (the host's statistics). A captured CUDA-graph step defers too: its
    optimizer steps eagerly between replays, and a rollback zeroes the gradient views the graph
    writes instead of freeing them. A model's after_step (MoE) takes the device flag instead of
    the verdict."""
    return skips_on_device(ctx.optimizer, ctx.device) and train_cfg.spike_zscore is None


def train(model: torch.nn.Module, train_cfg, state: TrainState, ctx: LoopContext) -> TrainState:
    ga = train_cfg.grad_accum_steps
    sync_every = bool(ctx.engine.engine_cfg.sync_every_microbatch)
    samples_per_step = train_cfg.micro_batch_size * ga * ctx.dp_size
    tokens_per_step = samples_per_step * ctx.spec.tokens_per_sample
    progress = RankProgress(train_cfg, state.step, ctx.progress_file, tokens_per_step) if ctx.rank == 0 else None
    timer = StepTimer(ctx.device)
    guard = StepGuard(train_cfg, ctx.rank)
    guard.start(state, ctx.scheduler, ctx.optimizer)
    defer = defers_verdict(ctx, train_cfg)
    # the optimizer's kernel divides the gradients by the clip's divisor as it reads them, in
    # every mode alike (a deferred run and one with host verdicts end on the same weights)
    clip_in_step = skips_on_device(ctx.optimizer, ctx.device)
    pending = None  # deferred: (step, PendingCheck) of the update launched before its verdict was read
    window = _Window()
    grad_norm = None
    model_row: dict = {}  # the model's own metrics of the last step (spec.after_step)
    # MoE: expert loads and the router's bias after every step (a collective); None for the rest
    after_step = getattr(ctx.spec, "after_step", None)

    def settle(step: int, check, applied: bool) -> str:
        """The guard's verdict on `step`; an OK step's optimizer step (unless `applied`: deferred,
        the device already skipped or applied it) and schedule step, and its loss counted."""
        nonlocal grad_norm
        verdict = guard.judge(step, check, state)
        grad_norm = check.grad_norm
        if verdict == OK:
            if not applied:
                ctx.optimizer.step()
            ctx.scheduler.step()
            window.loss_sum, window.good = window.loss_sum + check.loss, window.good + 1
        return verdict

    def roll_back(bad_step: int) -> None:
        nonlocal window
        _roll_back(model, state, ctx, guard, bad_step)
        timer.lap()
        window = _Window()

    def settle_pending() -> bool:
        """Judge the deferred step, whose update the device already applied or skipped; True when
        that rolled the run back (any gradients of the step since are dropped with it)."""
        nonlocal pending
        (late_step, late), pending = pending, None
        if settle(late_step, late.result(), applied=True) != ROLLBACK:
            return False
        ctx.optimizer.zero_grad(set_to_none=ctx.step_fn is None)  # a graph's gradient views stay
        if after_step is not None:  # the dropped step's expert loads, cleared
            after_step(model, False)
        roll_back(late_step)
        return True

    try:
        while state.step < train_cfg.steps:
            if ctx.profiler is not None:
                ctx.profiler.begin(state.step + 1)
            step_loss = torch.zeros((), device=ctx.device, dtype=torch.float32)
            weights = None
            if ctx.masked_labels:  # per-token loss: every micro-batch's targets counted first
                batches = [ctx.next_batch(state.step, micro) for micro in range(ga)]
                weights, step_targets = step_weights(batches, ctx.world_size)
                window.targets = step_targets if window.targets is None else window.targets + step_targets
            for micro in range(ga):
                if ctx.before_micro_batch is not None:
                    ctx.before_micro_batch(micro)
                ctx.engine.set_grad_sync(model, sync_every or micro == ga - 1)
                if ctx.step_fn is not None:
                    loss = ctx.step_fn()
                else:
                    batch = batches[micro] if weights is not None else ctx.next_batch(state.step, micro)
                    with ctx.forward_context():
                        loss = ctx.spec.loss(model, batch)
                    (loss / ga if weights is None else loss * weights[micro]).backward()
                step_loss += loss.detach().float() / ga if weights is None else loss.detach().float() * weights[micro]
            # Before the optimizer step, on every rank alike: a non-finite loss or gradient norm
            # (or a spike) is skipped, and too many in a row roll back (rank/step_guard.py).
            check = ctx.engine.check_step(model, train_cfg.grad_clip, step_loss, defer=defer,
                                          clip_in_step=clip_in_step)
            if clip_in_step:
                arm_device_step(ctx.optimizer, check.bad if defer else None, check.clip_divisor)
            if pending is not None and settle_pending():  # the previous step, now that this one's work is queued
                continue
            verdict = OK
            if defer:
                ctx.optimizer.step()
                pending = (state.step + 1, check)
            else:
                verdict = settle(state.step + 1, check, applied=False)
            ctx.optimizer.zero_grad(set_to_none=ctx.step_fn is None)
            if after_step is not None:
                model_row = after_step(model, 1.0 - check.bad if defer else verdict == OK)
            if verdict == ROLLBACK:
                roll_back(state.step + 1)
                continue
            state.step += 1
            if ctx.profiler is not None:
                ctx.profiler.end(state.step)
            state.consumed_samples += samples_per_step
            state.tokens_seen += tokens_per_step
            window.steps += 1

            stop = ctx.stop_requested(state.step)
            last = state.step == train_cfg.steps
            validating = _validation_due(ctx, train_cfg, state.step, last, stop)
            logging = state.step % train_cfg.log_interval == 0 or last or stop
            # the host's time since the last row, before anything waits for the device
            straggle = ctx.stragglers.check(window.steps) if logging and ctx.stragglers else {}
            # what follows reads the verdict (the row, the saved counters and schedule): judged now
            if pending is not None and (logging or validating
                                        or ctx.checkpoints.due(state.step, final=last, force=stop)):
                if settle_pending():
                    continue
            val_row = None
            if validating:
                val_row, seconds = validate(model, train_cfg.val_steps, state.step, ctx, progress)
                window.paused += seconds
            if logging:
                dt = (timer.lap() - window.paused) / window.steps  # validation is not training time
                mean_loss = window.loss_sum / window.good if window.good else float("nan")  # all skipped: nan
                row = {**_log_row(ctx, state, mean_loss, grad_norm, dt, tokens_per_step, window.blocked), **straggle}
                row["target_tokens_per_step"] = (
                    distinct_targets(window.targets.item(), ctx.token_copies) / window.steps
                    if window.targets is not None else tokens_per_step)
                row.update(bad_steps=guard.streak, skipped_steps=state.skipped_steps, rollbacks=state.rollbacks)
                row.update(host_values(model_row))
                window = _Window()
                if progress is not None:
                    progress.log(row)
                ctx.metrics.write({**row, **(val_row or {})})  # one row per step
            elif val_row is not None:
                ctx.metrics.write(val_row)
            if progress is not None:
                progress.advance(state.step)
            window.blocked += ctx.checkpoints.maybe_save(state.step, model, ctx.optimizer, ctx.scheduler, state,
                                                         final=last, force=stop,
                                                         val_loss=val_row["val_loss"] if val_row else None)
            if stop and not last:
                if ctx.rank == 0:
                    print(f"stopping at step {state.step} on request; checkpoint saved", flush=True)
                break
    except Diverged:
        ctx.checkpoints.wait()  # every rank raised it alike: an async save in flight still commits
        raise
    except Exception as exc:
        note_step(exc, state.step + 1)  # the step it escaped from, for the one-line OOM report (rank/oom.py)
        raise
    finally:
        if progress is not None:
            progress.close()
        if ctx.profiler is not None:
            ctx.profiler.close()
    return state


def _roll_back(model, state: TrainState, ctx: LoopContext, guard: StepGuard, bad_step: int) -> None:
    """Reload the newest intact checkpoint of this run (collective); Diverged when there is none."""
    before = state.state_dict()
    # Back to before the streak: checkpoints saved during it hold its first step's weights.
    to_step = ctx.checkpoints.rollback(model, ctx.optimizer, ctx.scheduler, state, at_most=guard.first_bad - 1)
    if to_step is None:
        raise guard.no_checkpoint(bad_step)
    guard.rolled_back(state, before, to_step, ctx.scheduler, ctx.optimizer)
    ctx.metrics.rewind(to_step)
    if ctx.step_fn is not None:
        ctx.step_fn.step = state.step  # the captured graph's batch position


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
    means, counts = [], []  # masked labels: per-token over every rank's batches
    try:
        with torch.no_grad():
            for i in range(val_steps):
                batch = ctx.val_batch(i)
                with ctx.forward_context():
                    mean = ctx.spec.loss(model, batch).detach().float()
                if ctx.masked_labels:
                    means.append(mean)
                    counts.append(target_count(batch))
                else:
                    total += mean
    finally:
        model.train(was_training)
    if ctx.masked_labels:
        loss = weighted_mean(means, counts, ctx.world_size)
    else:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)  # every rank's batches weigh the same
        loss = total.item() / (val_steps * ctx.world_size)
    row = {"step": step, "val_loss": loss, "val_ppl": math.exp(loss) if loss < 700 else float("inf")}
    seconds = time.perf_counter() - t0
    if progress is not None:
        progress.log_val(row, seconds)
    return row, seconds


def _log_row(ctx: LoopContext, state: TrainState, loss: float, grad_norm, dt: float,
             tokens_per_step: int, blocked: float) -> dict:
    """`loss`: the mean over ranks and the applied steps since the last row (check_step's)."""
    tokens_per_s_per_gpu = tokens_per_step / dt / ctx.world_size
    tflops = ctx.spec.flops_per_token * tokens_per_s_per_gpu / 1e12 if ctx.spec.flops_per_token else None
    return {
        "step": state.step,
        "loss": loss,
        # A device tensor under full-iteration CUDA graphs (capturable FusedAdam).
        "lr": float(ctx.optimizer.param_groups[0]["lr"]),
        "grad_norm": float(grad_norm) if grad_norm is not None else None,
        "tokens_per_s_per_gpu": tokens_per_s_per_gpu,
        "tflops_per_gpu": tflops,
        "mfu": mfu(tflops, ctx.peak_tflops),  # against the dense bf16 peak, FP8 runs too (the peers' figure)
        "mfu_at_precision": mfu(tflops, ctx.precision_peak_tflops),  # against the FP8-weighted peak
        "peak_mem_gib": peak_memory_gib(ctx.device),
        "peak_reserved_gib": peak_reserved_gib(ctx.device),
        "alloc_retries": alloc_retries(ctx.device),
        "step_time_s": dt,
        "tokens_seen": state.tokens_seen,
        "ckpt_blocked_s": blocked,
    }
