"""checkpoint.keep_best=val_loss (checkpoint/best.py): a validation that beats the best saves its
step, `checkpoints/best` points at the lowest one, keep_last never rotates it away, a resumed
manager knows it, `mfsdp-export RUN OUT --step best` writes it, and without validation data the
key is refused in one line."""

from __future__ import annotations

import pytest

from helpers import one_process_checkpoints, refused
from mfsdp_launch import checkpoint as C
from mfsdp_launch.checkpoint.best import BEST, read_best

torch = pytest.importorskip("torch")


def _step(model, opt, ts, mgr, step, val_loss=None, **kw):
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    ts.step = step
    mgr.maybe_save(step, model, opt, None, ts, val_loss=val_loss, **kw)


def test_the_best_validated_step_is_kept_and_exported(tmp_path, capsys):
    from mfsdp_launch.tools.export import main as export_main

    model, opt, ts, mgr = one_process_checkpoints(tmp_path, sizes=(8, 16, 4), lr=1e-2, interval=4, keep_last=1,
                                                  keep_best="val_loss")
    mgr.resume(model, opt, None, type(ts)())
    losses = {3: 3.0, 5: 2.0, 6: 2.5, 7: 1.9, 9: 2.4}  # validation at these steps (none at 4 and 8)
    weights = {}
    for step in range(1, 10):
        _step(model, opt, ts, mgr, step, val_loss=losses.get(step), final=step == 9)
        weights[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ckpts = tmp_path / "checkpoints"
    # Saved: the improvements (3, 5, 7) and the interval/final steps (4, 8, 9); keep_last=1 kept 9,
    # and the best (7) although it is older.
    assert C.committed_steps(ckpts) == [7, 9]
    assert (ckpts / BEST).read_text().strip() == "step_7" and read_best(ckpts).manifest["val_loss"] == 1.9
    assert "checkpoint step_7 is the best so far (val_loss 1.9000)" in capsys.readouterr().out
    # A resumed manager knows the best: a worse validation saves nothing.
    model2, opt2, ts2, mgr2 = one_process_checkpoints(tmp_path, sizes=(8, 16, 4), lr=1e-2, interval=0, keep_last=1,
                                                      keep_best="val_loss")
    mgr2.resume(model2, opt2, None, ts2)
    assert mgr2.best_val == 1.9
    _step(model2, opt2, ts2, mgr2, 10, val_loss=2.0)
    assert C.committed_steps(ckpts) == [7, 9]
    out = tmp_path / "best.pt"
    assert export_main([str(tmp_path), str(out), "--step", "best"]) == 0
    assert "of step 7 to" in capsys.readouterr().out
    exported = torch.load(out)
    assert all(torch.equal(exported[k], weights[7][k]) for k in weights[7])


def test_keep_best_and_step_best_refuse_in_one_line(tmp_path, capsys):
    from mfsdp_launch.tools.export import main as export_main

    e = refused("checkpoint.keep_best=val_loss")  # data=synthetic: no validation
    assert str(e).startswith("checkpoint.keep_best: val_loss needs validation") and "\n" not in str(e)
    model, opt, ts, mgr = one_process_checkpoints(tmp_path, sizes=(8, 16, 4), interval=1)
    _step(model, opt, ts, mgr, 1)
    assert export_main([str(tmp_path), str(tmp_path / "w.pt"), "--step", "best"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--step: best:" in err[0] and "has no best checkpoint" in err[0]
