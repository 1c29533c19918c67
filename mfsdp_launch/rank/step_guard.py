"""Bad steps: a non-finite loss or gradient norm (or, with `train.spike_zscore`, a loss spike) is
skipped; `train.max_bad_steps` of them in a row roll the run back to its newest intact
checkpoint; after `train.max_rollbacks` rollbacks the run stops (exit_codes.DIVERGED).

The loop asks `judge(step, check)` after every step's backward, before the optimizer step, with
the engine's `check_step` result, which is the same on every rank (one all-reduce), so every rank
decides alike; where the optimizer skips a bad step on the device by itself (torch's fused AdamW,
rank/loop.defers_verdict) it asks during the next step instead, with the same outcome:

    OK        apply the update
    SKIP      no optimizer step and no LR-schedule step (weights, optimizer state and schedule as
              they were), gradients zeroed; the step counter and the data position move on
    ROLLBACK  the max_bad_steps-th bad step in a row: reload the newest intact checkpoint (model,
              optimizer, schedule, RNG, data position) and train on from there; the LR is
              multiplied by train.rollback_lr_scale each time

The counters (`skipped_steps`, `rollbacks`, the LR scale) live in the TrainState, so they are
saved with checkpoints and survive a restart; a rollback keeps the run's counters rather than the
checkpoint's.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Optional

OK, SKIP, ROLLBACK = "ok", "skip", "rollback"

SPIKE_WINDOW = 100  # good steps whose losses make the spike baseline
SPIKE_MIN_STEPS = 20  # good steps before spikes are judged at all


class Diverged(RuntimeError):
    """Raised on every rank alike: the run cannot get past its bad steps. The worker prints the
    message as one line and exits with exit_codes.DIVERGED; the committed checkpoints are intact."""


class SpikeDetector:
    """A loss more than `zscore` standard deviations above the mean of the last SPIKE_WINDOW good
    steps' losses is a spike (judged once SPIKE_MIN_STEPS good steps were seen)."""

    def __init__(self, zscore: float, window: int = SPIKE_WINDOW, min_steps: int = SPIKE_MIN_STEPS):
        self.zscore, self.min_steps = float(zscore), int(min_steps)
        self.losses: deque = deque(maxlen=int(window))

    def score(self, loss: float) -> Optional[float]:
        """The z-score of `loss` against the window, None while the window is too short."""
        n = len(self.losses)
        if n < self.min_steps:
            return None
        mean = sum(self.losses) / n
        var = sum((x - mean) ** 2 for x in self.losses) / (n - 1)
        return (loss - mean) / max(math.sqrt(var), 1e-8 * max(1.0, abs(mean)))

    def is_spike(self, loss: float) -> Optional[float]:
        """The z-score when `loss` is a spike, else None."""
        z = self.score(loss)
        return z if z is not None and z > self.zscore else None

    def add(self, loss: float) -> None:
        self.losses.append(loss)


def _num(v: float) -> str:
    return f"{v:.4g}" if math.isfinite(v) else str(v)


class StepGuard:
    def __init__(self, train_cfg, rank: int):
        self.max_bad = int(train_cfg.max_bad_steps)
        self.max_rollbacks = int(train_cfg.max_rollbacks)
        self.lr_factor = float(train_cfg.rollback_lr_scale)
        z = train_cfg.spike_zscore
        self.spikes = SpikeDetector(z) if z is not None else None
        self.rank = rank
        self.streak = 0  # bad steps in a row, up to now
        self.first_bad: Optional[int] = None  # the first step of the streak

    def _say(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)

    def judge(self, step: int, check, state) -> str:
        """OK, SKIP or ROLLBACK for step `step` (1-based) with `check` (engines.base.StepCheck);
        counts skipped steps into `state`; raises Diverged when the run cannot go on."""
        reason = None
        if not check.finite:
            reason = f"loss {_num(check.loss)}, grad norm {_num(check.grad_norm)}"
            if check.bad_ranks:
                reason += f" (non-finite loss on {check.bad_ranks} rank(s))"
        elif self.spikes is not None:
            z = self.spikes.is_spike(check.loss)
            if z is not None:
                reason = f"loss {_num(check.loss)} is a spike (z-score {z:.1f} > train.spike_zscore={self.spikes.zscore:g})"
        if reason is None:
            self.streak, self.first_bad = 0, None
            if self.spikes is not None:
                self.spikes.add(check.loss)
            return OK
        self.streak += 1
        self.first_bad = self.first_bad or step
        state.skipped_steps += 1
        if self.max_bad == 0:
            raise Diverged(f"step {step}: {reason}; train.max_bad_steps=0 stops at the first bad step")
        if self.streak < self.max_bad:
            self._say(f"step {step}: {reason}: skipped, weights unchanged "
                      f"({self.streak} in a row; train.max_bad_steps={self.max_bad} roll back)")
            return SKIP
        if state.rollbacks >= self.max_rollbacks:
            raise Diverged(f"step {step}: {self.streak} bad steps in a row since step {self.first_bad} ({reason}) "
                           f"after {state.rollbacks} rollback(s) (train.max_rollbacks={self.max_rollbacks})")
        self._say(f"step {step}: {reason}: {self.streak} bad steps in a row since step {self.first_bad}, "
                  f"rolling back (rollback {state.rollbacks + 1} of train.max_rollbacks={self.max_rollbacks})")
        return ROLLBACK

    def no_checkpoint(self, step: int) -> Diverged:
        return Diverged(f"step {step}: {self.streak} bad steps in a row since step {self.first_bad} and no "
                        f"checkpoint of this run before step {self.first_bad} to roll back to (checkpoint.interval saves some)")

    def start(self, state, scheduler, optimizer) -> None:
        """At the loop's start: remember the configured base LRs; a resumed run that had rolled
        back with train.rollback_lr_scale gets its LR scale back."""
        self.config_base = [float(b) for b in getattr(scheduler, "base_lrs", None) or []]
        if state.lr_scale != 1.0:
            apply_lr_scale(scheduler, optimizer, self.config_base, state.lr_scale)
            self._say(f"LR x{state.lr_scale:g} (train.rollback_lr_scale after {state.rollbacks} rollback(s))")

    def rolled_back(self, state, before: dict, to_step: int, scheduler, optimizer) -> None:
        """After the checkpoint load: the run's counters (not the checkpoint's) with one more
        rollback, and the LR scale times train.rollback_lr_scale."""
        state.skipped_steps = before["skipped_steps"]
        state.rollbacks = before["rollbacks"] + 1
        state.lr_scale = before["lr_scale"] * self.lr_factor
        apply_lr_scale(scheduler, optimizer, self.config_base, state.lr_scale)
        lr = f"; LR x{state.lr_scale:g} from now on" if self.lr_factor != 1.0 else ""
        self._say(f"rolled back to step {to_step} (rollback {state.rollbacks} of "
                  f"train.max_rollbacks={self.max_rollbacks}){lr}")
        self.streak, self.first_bad = 0, None


def apply_lr_scale(scheduler, optimizer, config_base, scale: float) -> None:
    """Base LRs = the configured ones x `scale`; the current LRs in proportion (the schedule's
    factor at this step stays)."""
    from ..components.optim import set_lr

    if not config_base:
        return
    old = [float(b) for b in scheduler.base_lrs]
    new = [b * scale for b in config_base]
    scheduler.base_lrs = new
    for g, o, b in zip(optimizer.param_groups, old, new):
        g["initial_lr"] = b
        set_lr(g, float(g["lr"]) * (b / o) if o else b)
    scheduler._last_lr = [float(g["lr"]) for g in optimizer.param_groups]
