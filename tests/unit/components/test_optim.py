"""optim.schedule: each LR curve against its formula, the default unchanged; optim.impl's AdamW
kernels; Muon's Newton-Schulz step; and the refusals of the optimizer keys before anything is
spawned. Muon sharded under FSDP2 and resumed at another world size: test_muon_dist.py."""

from __future__ import annotations

import math

import pytest

from helpers import refused
from mfsdp_launch.components.schedule import build_scheduler, lr_at, wsd_decay_start
from mfsdp_launch.core.schema import OptimConfig


def _curve(cfg: OptimConfig, total: int):
    return [lr_at(s, cfg, total) for s in range(total)]


def test_wsd_is_warmup_stable_then_linear_decay():
    cfg = OptimConfig(schedule="wsd", lr=1.0, min_lr_ratio=0.1, warmup_steps=4, decay_steps=None, decay_fraction=0.25)
    total = 40
    start = total - round(0.25 * total)  # 30
    assert wsd_decay_start(cfg, total) == start
    expected = ([(s + 1) / 4 for s in range(4)] + [1.0] * (start - 4)
                + [1.0 - 0.9 * (s - start) / (total - start) for s in range(start, total)])
    assert _curve(cfg, total) == pytest.approx(expected, abs=1e-12)
    assert lr_at(total, cfg, total) == pytest.approx(0.1)  # the floor, and it stays there
    assert lr_at(total + 7, cfg, total) == pytest.approx(0.1)
    # decay_steps sets the schedule's length independently of train.steps
    long = OptimConfig(schedule="wsd", lr=2.0, min_lr_ratio=0.0, warmup_steps=0, decay_steps=100, decay_fraction=0.1)
    assert lr_at(89, long, 10) == 2.0 and lr_at(90, long, 10) == 2.0 and lr_at(95, long, 10) == pytest.approx(1.0)


def test_the_default_is_the_cosine_it_was_and_the_others_follow_their_formula():
    cfg = OptimConfig(lr=3e-4, warmup_steps=10, min_lr_ratio=0.1)
    assert str(cfg.schedule) == "cosine"
    floor = 3e-5
    for s in (10, 37, 99):
        p = (s - 10) / 90
        assert lr_at(s, cfg, 100) == pytest.approx(floor + 0.5 * (3e-4 - floor) * (1 + math.cos(math.pi * p)))
    lin = OptimConfig(schedule="linear", lr=1.0, warmup_steps=2, min_lr_ratio=0.5)
    assert _curve(lin, 12)[2:] == pytest.approx([1.0 - 0.5 * (s - 2) / 10 for s in range(2, 12)])
    const = OptimConfig(schedule="constant", lr=0.5, warmup_steps=2)
    assert _curve(const, 6) == pytest.approx([0.25, 0.5, 0.5, 0.5, 0.5, 0.5])


def test_the_scheduler_steps_through_the_same_curve():
    import torch

    cfg = OptimConfig(schedule="wsd", lr=0.1, warmup_steps=2, decay_fraction=0.5)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    sched = build_scheduler(opt, cfg, 8)
    seen = []
    for _ in range(8):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx(_curve(cfg, 8), abs=1e-15)


@pytest.mark.parametrize("impl,flag", [("fused", "fused"), ("foreach", "foreach")])
def test_optim_impl_picks_the_adamw_kernel(impl, flag):
    import torch

    from mfsdp_launch.components.optim import build_optimizer

    opt = build_optimizer(torch.nn.Linear(4, 4), OptimConfig(impl=impl))
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults[flag] is True
    assert build_optimizer(torch.nn.Linear(4, 4), OptimConfig()).defaults["fused"] is None  # torch's own choice


def test_a_step_armed_with_the_clip_divisor_moves_the_weights_as_clipped_gradients_do():
    """torch's fused AdamW divides each gradient by `grad_scale` as its kernel reads it: the loop's
    clip in the step (Engine.check_step(clip_in_step=True) + arm_device_step) lands where
    scaling the gradients first (clip_to_norm) does, to float rounding, over steps whose clips
    differ (Adam's update is blind to one common scale); `found_inf` skips a step."""
    import torch

    from mfsdp_launch.components.optim import arm_device_step, skips_on_device
    from mfsdp_launch.engines.base import clip_divisor, clip_to_norm

    torch.manual_seed(0)
    start = [torch.randn(33, 7), torch.randn(5)]
    runs = {name: [torch.nn.Parameter(t.clone()) for t in start] for name in ("scaled", "in_step", "unclipped")}
    opts = {name: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True) for name, ps in runs.items()}
    assert all(skips_on_device(o, torch.device("cpu")) for o in opts.values())
    for step, size in enumerate((1.0, 30.0, 3.0)):
        grads = [size * torch.randn_like(t) for t in start]
        total = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        for name, params in runs.items():
            for p, g in zip(params, grads):
                p.grad = g.clone()
        clip_to_norm([p.grad for p in runs["scaled"]], total, 1.0)
        arm_device_step(opts["in_step"], torch.zeros(()), clip_divisor(total, 1.0))
        for o in opts.values():
            o.step()
    for p, q in zip(runs["scaled"], runs["in_step"]):
        assert torch.allclose(p, q, rtol=1e-6, atol=1e-6), (p - q).abs().max()
    assert not all(torch.allclose(p, q, atol=1e-4) for p, q in zip(runs["scaled"], runs["unclipped"]))
    before = [p.detach().clone() for p in runs["in_step"]]
    arm_device_step(opts["in_step"], torch.ones(()), clip_divisor(total, 1.0))  # a bad step
    opts["in_step"].step()
    assert all(torch.equal(p, b) for p, b in zip(runs["in_step"], before))


@pytest.mark.parametrize("decoupled", [False, True])
def test_te_fusedadam_reads_the_gradients_where_the_engine_puts_them(monkeypatch, decoupled):
    """engine.use_decoupled_grad=true installs gradients in param.decoupled_grad; TE's FusedAdam reads
    them there only when built with use_decoupled_grad=True (TE itself is GPU-only: a stand-in class
    records the arguments the launcher passes)."""
    import sys
    import types

    import torch

    from mfsdp_launch.components.optim import build_optimizer

    class FusedAdam(torch.optim.AdamW):
        def __init__(self, params, adam_w_mode, use_decoupled_grad=False, **kw):
            super().__init__(params, **kw)
            self.use_decoupled_grad = use_decoupled_grad

    module = types.ModuleType("transformer_engine.pytorch.optimizers")
    module.FusedAdam = FusedAdam
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.optimizers", module)
    opt = build_optimizer(torch.nn.Linear(4, 4), OptimConfig(impl="te_fused"), decoupled_grad=decoupled)
    assert isinstance(opt, FusedAdam) and opt.use_decoupled_grad is decoupled


def test_newton_schulz_orthogonalizes_and_one_muon_step_follows_its_formula():
    import torch

    from mfsdp_launch.components.muon import orthogonalize, update_scale
    from mfsdp_launch.components.optim import build_optimizer

    g = torch.randn(96, 32, generator=torch.Generator().manual_seed(0))
    o = orthogonalize(g)
    s = torch.linalg.svdvals(o)
    assert 0.5 < s.min() and s.max() < 1.5  # the quintic's S' ~ U(0.5, 1.5), not exactly 1
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    assert torch.nn.functional.cosine_similarity(o.flatten(), (u @ vh).flatten(), dim=0) > 0.95
    lin = torch.nn.Linear(32, 96, bias=False)
    w0 = lin.weight.detach().clone()
    cfg = OptimConfig(name="muon", lr=0.02, weight_decay=0.1, muon_momentum=0.9)
    opt = build_optimizer(lin, cfg)
    lin.weight.grad = g.clone()
    opt.step()
    mixed = g.lerp(0.1 * g, 0.9)  # Nesterov: g + mu * (B - g) with B = (1 - mu) g after one step
    expect = w0 * (1 - 0.02 * 0.1) - 0.02 * update_scale(g.shape) * orthogonalize(mixed)
    assert torch.allclose(lin.weight, expect, atol=1e-6)


@pytest.mark.parametrize("overrides,key", [
    (["optim.name=muon", "engine=megatron_fsdp"], "optim.name"),
    (["optim.name=muon", "optim.impl=foreach"], "optim.impl"),
    (["optim.name=muon", "optim.muon_momentum=1"], "optim.muon_momentum"),
    (["optim.muon_momentum=0.9"], "optim.muon_momentum"),  # read by muon only
    (["optim.decay_fraction=0.5"], "optim.decay_fraction"),  # read by wsd only
    (["optim.schedule=wsd", "optim.decay_fraction=0"], "optim.decay_fraction"),
    (["optim.decay_steps=0"], "optim.decay_steps"),
    (["optim.schedule=exponential"], "optim.schedule"),
    (["optim.name=sgd"], "optim.name"),
])
def test_optimizer_keys_are_refused_in_one_line(overrides, key):
    err = refused(*overrides)
    assert err.key == key and "\n" not in str(err), str(err)


def test_a_resume_that_changes_the_optimizer_is_refused_but_its_weights_load():
    from mfsdp_launch.checkpoint.manifest import incompatibilities

    now, saved = {"config": {"optim": {"name": "muon"}}}, {"config": {"optim": {}}}  # saved before the key: adamw
    assert incompatibilities(now, saved, weights_only=False) == [("optim.name", "muon", "adamw")]
    assert incompatibilities(now, saved, weights_only=True) == []
    assert incompatibilities({"config": {"optim": {"name": "adamw"}}}, saved, weights_only=False) == []
