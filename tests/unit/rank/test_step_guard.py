"""The bad-step decisions (rank/step_guard.py) on StepCheck values: skip, roll back, stop; loss
spikes with train.spike_zscore; the LR scale after a rollback. (Real processes: tests/e2e/test_bad_steps_e2e.py.)"""

from __future__ import annotations

import pytest
import torch

from helpers import refused
from mfsdp_launch.core.schema import TrainConfig
from mfsdp_launch.engines.base import StepCheck
from mfsdp_launch.rank.loop import TrainState
from mfsdp_launch.rank.step_guard import OK, ROLLBACK, SKIP, Diverged, SpikeDetector, StepGuard

GOOD, NAN = StepCheck(grad_norm=1.0, loss=2.0, finite=True), StepCheck(float("nan"), float("nan"), False, 1)


def test_bad_steps_skip_then_roll_back_then_stop():
    guard, state = StepGuard(TrainConfig(max_bad_steps=2, max_rollbacks=1), rank=1), TrainState()
    assert [guard.judge(s, c, state) for s, c in enumerate([GOOD, NAN, GOOD, NAN], 1)] == [OK, SKIP, OK, SKIP]
    assert guard.judge(5, NAN, state) == ROLLBACK and (guard.first_bad, state.skipped_steps) == (4, 3)
    before = state.state_dict()
    state.load_state_dict({"step": 2, "tokens_seen": 0, "consumed_samples": 0})  # the checkpoint's (older) counters
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5)
    guard.start(state, sched, opt)
    guard.rolled_back(state, before, 2, sched, opt)
    assert (state.skipped_steps, state.rollbacks, guard.streak) == (3, 1, 0)
    assert guard.judge(3, NAN, state) == SKIP
    with pytest.raises(Diverged, match=r"^step 4: 2 bad steps in a row since step 3 \(loss nan, grad norm nan "
                                       r"\(non-finite loss on 1 rank\(s\)\)\) after 1 rollback\(s\)"):
        guard.judge(4, NAN, state)
    with pytest.raises(Diverged, match="train.max_bad_steps=0 stops at the first bad step"):
        StepGuard(TrainConfig(max_bad_steps=0), rank=0).judge(1, NAN, TrainState())


def test_the_lr_scale_applies_after_a_rollback_and_again_at_a_resume():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    opt.step()
    sched.step()  # lr 0.5
    guard, state = StepGuard(TrainConfig(rollback_lr_scale=0.5), rank=1), TrainState(step=1)
    guard.start(state, sched, opt)
    guard.rolled_back(state, state.state_dict(), 1, sched, opt)
    assert state.lr_scale == 0.5 and sched.base_lrs == [0.5] and opt.param_groups[0]["lr"] == 0.25
    opt.step()
    sched.step()  # the schedule goes on from the scaled base
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5 / 3)
    # a resumed run (the configured base LR again) gets its scale back from the train state
    opt2 = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0 / (s + 1))
    StepGuard(TrainConfig(rollback_lr_scale=0.5), rank=1).start(state, sched2, opt2)
    assert sched2.base_lrs == [0.5] and opt2.param_groups[0]["lr"] == 0.5


def test_a_loss_spike_is_a_bad_step_only_with_spike_zscore():
    det = SpikeDetector(4.0)
    for i in range(30):
        if i == det.min_steps - 1:
            assert det.is_spike(100.0) is None  # too few steps to judge
        det.add(2.0 + 0.01 * (i % 3))
    assert det.is_spike(2.03) is None and det.is_spike(3.0) > 4.0
    guard, state = StepGuard(TrainConfig(spike_zscore=4.0), rank=1), TrainState()
    for s in range(1, 31):
        assert guard.judge(s, StepCheck(1.0, 2.0 + 0.01 * (s % 3), True), state) == OK
    assert guard.judge(31, StepCheck(1.0, 3.0, True), state) == SKIP and state.skipped_steps == 1
    plain = StepGuard(TrainConfig(), rank=1)  # off by default
    assert all(plain.judge(s, StepCheck(1.0, 2.0 if s < 31 else 30.0, True), state) == OK for s in range(1, 32))


@pytest.mark.parametrize("override,key,problem", [
    ("train.max_bad_steps=-1", "train.max_bad_steps", "must be >= 0, got -1"),
    ("train.max_rollbacks=-2", "train.max_rollbacks", "must be >= 0, got -2"),
    ("train.rollback_lr_scale=0", "train.rollback_lr_scale", "must be in (0, 1], got 0.0"),
    ("train.rollback_lr_scale=1.5", "train.rollback_lr_scale", "must be in (0, 1], got 1.5"),
    ("train.spike_zscore=0", "train.spike_zscore", "must be > 0, got 0.0"),
])
def test_bad_step_keys_are_refused_in_one_line_before_spawning(override, key, problem):
    err = refused(override)
    assert err.key == key and err.problem == problem and "\n" not in str(err)
