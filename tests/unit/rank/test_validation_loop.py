"""The loop in one process (a 1-rank gloo group): when the validation hook runs, what it writes,
and that training is the same with it; a non-finite step is skipped (weights, optimizer state and
LR schedule as before it), with its verdict read on the host or a step late, for an MoE too."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from helpers import model_cfg, one_rank_group, read_metrics
from mfsdp_launch.rank.loop import LoopContext, TrainState, defers_verdict, train
from mfsdp_launch.components.metrics import MetricsWriter
from mfsdp_launch.core.schema import EngineConfig, TrainConfig
from mfsdp_launch.engines.base import Engine


class PlainEngine(Engine):
    """The engine interface's own gradient check and clipping on an unsharded model."""

    name = "plain"

    def shard(self, model, spec, *, init_on_meta):
        return model

    def wrap_optimizer(self, model, optimizer):
        return optimizer

    def set_grad_sync(self, model, sync):
        pass

    def state_dict(self, model, optimizer):
        raise NotImplementedError

    def load_state_dict(self, model, optimizer, state):
        raise NotImplementedError


@pytest.fixture(scope="module", autouse=True)
def process_group(tmp_path_factory):
    with one_rank_group(tmp_path_factory.mktemp("pg") / "store"):
        yield


def batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 4, generator=g)
    return {"x": x, "y": x.sum(-1, keepdim=True) + 0.1 * torch.randn(8, 1, generator=g)}


def moe_model():
    """The built-in tiny MoE gpt with the sigmoid router, whose bias moves on applied steps only
    (models/llama/moe_stats.after_step), and its spec: a batch marked "nan" gives a NaN loss."""
    from mfsdp_launch.models import family
    from mfsdp_launch.models.llama.config import MoEConfig

    m = model_cfg("gpt", preset="tiny_moe", moe=MoEConfig(router="sigmoid", aux_loss_coef=0.01, bias_update_rate=0.01))
    spec = family("gpt").spec(m, 16)
    base = spec.loss
    spec.loss = lambda model, b: base(model, b) * (float("nan") if b.get("nan") else 1.0)
    return spec.build(), spec


def token_batch(seed: int) -> dict:
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


class StaticStep:
    """The loop's contract with a captured iteration (components/cuda_graph.py), run eagerly: each
    call trains the next step's batch into gradients the loop zeroes but never frees."""

    def __init__(self, model, spec, next_batch):
        self.model, self.spec, self.next_batch, self.step = model, spec, next_batch, 0

    def __call__(self):
        loss = self.spec.loss(self.model, self.next_batch(self.step, 0))
        loss.backward()
        self.step += 1
        return loss


def run(tmp_path, *, steps=6, log_interval=2, val_interval=3, validate=True, stop_at=None, nan_at=None,
        with_state=False, fused=False, spike_zscore=None, moe=False, graph=False, ga=1, before_micro_batch=None):
    """fused=True: torch's fused AdamW, which skips a bad step on the device, so the loop reads each
    verdict a step late (rank/loop.defers_verdict) unless spike_zscore asks for the host's.
    moe=True: the tiny MoE gpt (moe_model) on token batches instead of the regression MLP.
    graph=True: the steps come from a StaticStep, as from a full-iteration CUDA graph."""
    torch.manual_seed(0)
    if moe:
        model, spec = moe_model()
        make = token_batch
        bad = {**token_batch(nan_at or 0), "nan": True}
    else:
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 1))
        spec = types.SimpleNamespace(loss=lambda m, b: torch.nn.functional.mse_loss(m(b["x"]), b["y"]),
                                     tokens_per_sample=1, flops_per_token=None)
        make = batch
        bad = {"x": torch.full((8, 4), float("nan")), "y": torch.zeros(8, 1)}
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, fused=fused or None)
    engine = PlainEngine(engine_cfg=EngineConfig(), sharding_cfg=None, precision_cfg=None, dims=None, mesh=None,
                         device=torch.device("cpu"))
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    tmp_path.mkdir()
    metrics = MetricsWriter(tmp_path, enabled=True)
    next_batch = lambda step, micro: make(step) if step != nan_at else bad  # noqa: E731
    ctx = LoopContext(engine=engine, spec=spec, optimizer=opt,
                      scheduler=scheduler,
                      next_batch=next_batch, step_fn=StaticStep(model, spec, next_batch) if graph else None,
                      forward_context=contextlib.nullcontext,
                      device=torch.device("cpu"), world_size=1, dp_size=1, rank=1, peak_tflops=None,
                      metrics=metrics, checkpoints=types.SimpleNamespace(maybe_save=lambda *a, **k: 0.0, due=lambda *a, **k: False),
                      stop_requested=lambda step: step == stop_at,
                      val_batch=(lambda i: make(1000 + i)) if validate else None,
                      before_micro_batch=before_micro_batch)
    cfg = TrainConfig(steps=steps, grad_accum_steps=ga, micro_batch_size=8, log_interval=log_interval,
                      grad_clip=1.0, val_interval=val_interval, val_steps=2, progress=False, spike_zscore=spike_zscore)
    assert defers_verdict(ctx, cfg) == (fused and spike_zscore is None)
    state = train(model, cfg, TrainState(), ctx)
    metrics.close()
    rows = read_metrics(tmp_path)
    # the MoE routers' biases last (moved by after_step on applied steps; none in the MLP)
    params = [p.detach().clone() for p in model.parameters()]
    params += [b.clone() for name, b in model.named_buffers() if name.endswith("expert_bias")]
    if with_state:
        return rows, params, state, opt, scheduler
    return rows, params


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


@pytest.mark.parametrize("fused", [False, True], ids=["host_verdict", "device_skip"])
def test_a_non_finite_step_is_skipped_weights_optimizer_and_schedule_unchanged(tmp_path, fused):
    # step 4 trains on batch 3, all NaN: skipped, so the run equals one that stopped after step 3
    rows, params, state, opt, sched = run(tmp_path / "nan", steps=4, log_interval=1, val_interval=3, nan_at=3,
                                          with_state=True, fused=fused)
    _, ref, _, ref_opt, ref_sched = run(tmp_path / "ref", steps=3, log_interval=1, val_interval=3, with_state=True,
                                        fused=fused)
    assert all(torch.equal(a, b) for a, b in zip(params, ref))
    assert sched.last_epoch == ref_sched.last_epoch == 3 and opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    for p, q in zip(opt.state.values(), ref_opt.state.values()):
        assert all(torch.equal(p[k], q[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    assert all(p.grad is None for p in opt.param_groups[0]["params"])  # zeroed
    row = {r["step"]: r for r in rows if "loss" in r}[4]
    assert row["skipped_steps"] == 1 and row["bad_steps"] == 1 and row["loss"] != row["loss"]  # nan: none applied
    assert state.step == 4 and state.skipped_steps == 1 and state.consumed_samples == 4 * 8
    # the run goes on after it: the streak ends at the next good step
    more, after = run(tmp_path / "on", steps=6, log_interval=1, val_interval=3, nan_at=3, fused=fused)
    assert [r["bad_steps"] for r in more if "loss" in r] == [0, 0, 0, 1, 0, 0]
    assert all(torch.isfinite(p).all() for p in after)


def test_a_verdict_read_a_step_late_trains_as_the_host_verdict_does(tmp_path):
    # The same fused AdamW, verdicts read late (the device skips) or before each step (the host
    # decides; spike_zscore needs it there): the same weights, optimizer state, schedule and rows.
    # Log rows every 4 steps: the bad step 5 (batch 4) is judged during step 6.
    late = run(tmp_path / "late", steps=9, log_interval=4, val_interval=0, validate=False, nan_at=4,
               with_state=True, fused=True)
    host = run(tmp_path / "host", steps=9, log_interval=4, val_interval=0, validate=False, nan_at=4,
               with_state=True, fused=True, spike_zscore=1e9)
    (rows, params, state, opt, sched), (ref_rows, ref, ref_state, ref_opt, ref_sched) = late, host
    assert all(torch.equal(a, b) for a, b in zip(params, ref))
    for p, q in zip(opt.state.values(), ref_opt.state.values()):
        assert all(torch.equal(p[k], q[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    assert sched.last_epoch == ref_sched.last_epoch == 8 and state == ref_state and state.skipped_steps == 1
    keys = ("step", "loss", "lr", "grad_norm", "bad_steps", "skipped_steps")
    assert [[r[k] for k in keys] for r in rows] == [[r[k] for k in keys] for r in ref_rows]
    assert [r["step"] for r in rows] == [4, 8, 9] and rows[1]["skipped_steps"] == 1


def test_a_graphed_step_read_late_trains_as_the_host_verdict_does(tmp_path):
    # Steps from a captured iteration's contract defer their verdict too: the skipped step 5 and
    # the rest train as with host verdicts, and the gradients stay allocated (a graph writes into
    # them), zeroed after every step.
    late = run(tmp_path / "late", steps=9, log_interval=4, val_interval=0, validate=False, nan_at=4,
               with_state=True, fused=True, graph=True)
    host = run(tmp_path / "host", steps=9, log_interval=4, val_interval=0, validate=False, nan_at=4,
               with_state=True, fused=True, spike_zscore=1e9, graph=True)
    eager = run(tmp_path / "eager", steps=9, log_interval=4, val_interval=0, validate=False, nan_at=4,
                with_state=True, fused=True)
    (rows, params, state, opt, _), (ref_rows, ref, ref_state, _, _) = late, host
    assert all(torch.equal(a, b) for a, b in zip(params, ref)) and state == ref_state and state.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(params, eager[1]))
    keys = ("step", "loss", "lr", "grad_norm", "bad_steps", "skipped_steps")
    assert [[r[k] for k in keys] for r in rows] == [[r[k] for k in keys] for r in ref_rows]
    assert [r["step"] for r in rows] == [4, 8, 9] and rows[1]["skipped_steps"] == 1
    grads = [p.grad for p in opt.param_groups[0]["params"]]
    assert all(g is not None and not g.any() for g in grads)


def test_a_moe_step_read_late_moves_the_router_bias_as_the_host_verdict_does(tmp_path):
    # The MoE's after_step takes the device flag when the verdict is read late: the skipped step 5
    # (batch 4) moves no expert bias, and the weights, biases and each row's expert metrics equal
    # those of host verdicts.
    runs = [run(tmp_path / name, steps=7, log_interval=3, val_interval=0, validate=False, nan_at=4, fused=True,
                spike_zscore=z, moe=True) for name, z in (("late", None), ("host", 1e9))]
    (rows, params), (ref_rows, ref) = runs
    assert len(params) == len(ref) and all(torch.equal(a, b) for a, b in zip(params, ref))
    keys = ("step", "loss", "grad_norm", "skipped_steps", "moe_aux_loss", "moe_load_max")
    assert [[r[k] for k in keys] for r in rows] == [[r[k] for k in keys] for r in ref_rows]
    assert [r["step"] for r in rows] == [3, 6, 7] and rows[1]["skipped_steps"] == 1
    assert len(rows[0]["moe_load_max"]) == 2 and rows[0]["moe_aux_loss"] > 0.5
    biases = params[len(list(moe_model()[0].parameters())):]
    assert len(biases) == 2 and all(b.abs().sum() > 0 for b in biases)  # moved on the applied steps


def test_the_loop_announces_each_micro_batch_before_it_runs(tmp_path):
    """fp8.cache_weight_casts relies on it: index 0 starts every step (a skipped one too), before
    its forward."""
    seen = []
    run(tmp_path / "micro", steps=4, ga=3, validate=False, nan_at=2, before_micro_batch=seen.append)
    assert seen == [0, 1, 2] * 4
