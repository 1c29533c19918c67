"""The loop's validation hook in one process (a 1-rank gloo group): when it runs, what it writes,
and that training is the same with it."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from helpers import one_rank_group, read_metrics
from mfsdp_launch.rank.loop import LoopContext, TrainState, train
from mfsdp_launch.components.metrics import MetricsWriter
from mfsdp_launch.core.schema import EngineConfig


@pytest.fixture(scope="module", autouse=True)
def process_group(tmp_path_factory):
    with one_rank_group(tmp_path_factory.mktemp("pg") / "store"):
        yield


def batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 4, generator=g)
    return {"x": x, "y": x.sum(-1, keepdim=True) + 0.1 * torch.randn(8, 1, generator=g)}


def run(tmp_path, *, steps=6, log_interval=2, val_interval=3, validate=True, stop_at=None, nan_at=None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    engine = types.SimpleNamespace(engine_cfg=EngineConfig(), set_grad_sync=lambda m, on: None,
                                   clip_grad_norm=lambda m, c: torch.tensor(1.0))
    spec = types.SimpleNamespace(loss=lambda m, b: torch.nn.functional.mse_loss(m(b["x"]), b["y"]),
                                 tokens_per_sample=1, flops_per_token=None)
    tmp_path.mkdir()
    metrics = MetricsWriter(tmp_path, enabled=True)
    ctx = LoopContext(engine=engine, spec=spec, optimizer=opt,
                      scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                      next_batch=lambda step, micro: batch(step) if step != nan_at else {"x": torch.full((8, 4), float("nan")),
                                                                                           "y": torch.zeros(8, 1)},
                      forward_context=contextlib.nullcontext,
                      device=torch.device("cpu"), world_size=1, dp_size=1, rank=1, peak_tflops=None,
                      metrics=metrics, checkpoints=types.SimpleNamespace(maybe_save=lambda *a, **k: 0.0),
                      stop_requested=lambda step: step == stop_at,
                      val_batch=(lambda i: batch(1000 + i)) if validate else None)
    cfg = types.SimpleNamespace(steps=steps, grad_accum_steps=1, micro_batch_size=8, log_interval=log_interval,
                                grad_clip=None, val_interval=val_interval, val_steps=2, progress=False)
    train(model, cfg, TrainState(), ctx)
    metrics.close()
    rows = read_metrics(tmp_path)
    return rows, [p.detach().clone() for p in model.parameters()]


def test_validation_rows_and_unchanged_training(tmp_path):
    rows, params = run(tmp_path / "val")
    assert [r["step"] for r in rows] == [2, 3, 4, 6]  # one row per step
    assert set(rows[1]) == {"step", "val_loss", "val_ppl"}  # step 3: validation only
    assert {"loss", "val_loss", "val_ppl"} <= set(rows[3])  # step 6 (the last): merged into the training row
    # the model is back in train mode after validation (dropout on) and trained exactly as without it
    plain_rows, plain_params = run(tmp_path / "plain", validate=False)
    assert [(r["step"], r["loss"]) for r in plain_rows] == [(r["step"], r["loss"]) for r in rows if "loss" in r]
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))


def test_a_final_validation_but_none_when_stopping_early(tmp_path):
    rows, _ = run(tmp_path / "end", val_interval=0)
    assert [r["step"] for r in rows if "val_loss" in r] == [6]  # val_interval=0: only after the last step
    stopped, _ = run(tmp_path / "stop", val_interval=2, stop_at=4)
    assert [r["step"] for r in stopped if "val_loss" in r] == [2]  # the stop at step 4 skips validation


def test_a_non_finite_loss_still_stops_the_run_with_validation_on(tmp_path):
    with pytest.raises(FloatingPointError, match="loss is nan at step 4"):
        run(tmp_path / "nan", log_interval=1, val_interval=3, nan_at=3)  # step 4 trains on batch 3
