"""CheckpointManager in one process with real DCP: non-finite weights are never committed, and
`rollback` reloads the newest intact step at or before the one asked for (the bad-step guard's
target, rank/step_guard.py), passing over a damaged one."""

from __future__ import annotations

import pytest

from helpers import one_process_checkpoints
from mfsdp_launch import checkpoint as C
from mfsdp_launch.checkpoint.errors import CheckpointError

torch = pytest.importorskip("torch")


def _tiny(run_dir, **ck):
    model, opt, ts, mgr = one_process_checkpoints(run_dir, sizes=(8, 16, 4), lr=1e-2, **ck)
    mgr.resume(model, opt, None, type(ts)())  # a fresh state of its own, as the loop's
    return model, opt, ts, mgr


def _step(model, opt, ts, mgr, step, **kw):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    ts.step = step
    mgr.maybe_save(step, model, opt, None, ts, **kw)


def test_non_finite_weights_are_never_committed(tmp_path, capsys):
    model, opt, ts, mgr = _tiny(tmp_path, interval=1)
    _step(model, opt, ts, mgr, 1)
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    _step(model, opt, ts, mgr, 2)  # a periodic save: skipped with a warning
    assert C.committed_steps(tmp_path / "checkpoints") == [1]
    assert "checkpoint: warning: checkpoint of step 2 not saved: the model's weights are not finite; the " \
           "committed checkpoints are intact: step_1" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="checkpoint of step 3 not saved: the model's weights are not finite"):
        _step(model, opt, ts, mgr, 3, final=True)  # the last save: the run stops instead
    assert C.committed_steps(tmp_path / "checkpoints") == [1]


def test_rollback_loads_the_newest_intact_step_before_the_bad_ones(tmp_path, capsys):
    from mfsdp_launch.checkpoint.weights import read_model_state

    model, opt, ts, mgr = _tiny(tmp_path, interval=1, keep_last=10)
    for step in (1, 2, 3, 4):
        _step(model, opt, ts, mgr, step)
    ck = tmp_path / "checkpoints"
    with open(next((ck / "step_3").glob("*.distcp")), "r+b") as f:  # same-size damage in step_3
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0xFF]))
    assert mgr.rollback(model, opt, None, ts, at_most=3) == 2  # step_4 is too late, step_3 damaged
    assert ts.step == 2 and "step_3 is damaged" in capsys.readouterr().out
    saved = read_model_state(ck / "step_2")[0]
    assert all(torch.equal(saved[f"{i}.{k}"], getattr(model[i], k)) for i in (0, 2) for k in ("weight", "bias"))
    assert mgr.saver.have_steps == {1, 2}  # steps 3 and 4 are saved again as the run gets there
    assert mgr.rollback(model, opt, None, ts, at_most=0) is None
