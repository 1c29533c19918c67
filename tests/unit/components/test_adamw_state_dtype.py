"""optim.state_dtype=bf16 (components/adamw.py): the launcher's AdamW is torch's update (bitwise,
with fp32 moments), its bf16 moments take half the bytes and follow the fp32 run; on real FSDP2
(gloo ranks) and DCP a sharded step equals one process's, and a checkpoint with bf16 moments
resumes at another world size and into fp32 moments. The memory estimate and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import one_rank_group, refused, run_ranks
from sharded_optim import checkpoint_manager, sharded_gpt, tiny_gpt, train_step as _step

torch = pytest.importorskip("torch")

from mfsdp_launch.components import adamw  # noqa: E402
from mfsdp_launch.components.optim import build_optimizer  # noqa: E402
from mfsdp_launch.core.schema import OptimConfig  # noqa: E402

STEPS, SAVE_AT = 5, 3


def _params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for shape in ((300, 70), (70,), (5000,), (8, 8))]


def _run(make, steps: int = 10):
    params = [p.clone().requires_grad_() for p in _params()]
    opt = make([{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}])
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return params, opt


def test_fp32_moments_are_torch_adamw_bitwise_in_any_chunking(monkeypatch):
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ref, _ = _run(lambda groups: torch.optim.AdamW(groups, foreach=True, **kw))
    monkeypatch.setattr(adamw, "WORK_CHUNK_ELEMENTS", 6000)  # chunks of one or two tensors
    ours, _ = _run(lambda groups: adamw.AdamW(groups, state_dtype=torch.float32, **kw))
    assert all(torch.equal(a, b) for a, b in zip(ref, ours))


def test_bf16_moments_are_the_same_in_any_chunking_and_pieces(monkeypatch):
    """A tensor over WORK_CHUNK_ELEMENTS is updated in pieces (the 300 x 70 and 5000 ones at 1000):
    elementwise, so the result is the same as in one piece."""
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    whole, whole_opt = _run(lambda groups: adamw.AdamW(groups, **kw))
    monkeypatch.setattr(adamw, "WORK_CHUNK_ELEMENTS", 1000)
    cut, cut_opt = _run(lambda groups: adamw.AdamW(groups, **kw))
    assert all(torch.equal(a, b) for a, b in zip(whole, cut))
    for a, b in zip(whole_opt.state.values(), cut_opt.state.values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    assert adamw._pieces(([torch.zeros(2500)],), 1000) == [(0, 0, 1000), (0, 1000, 2000), (0, 2000, 2500)]


def test_bf16_moments_take_half_the_bytes_and_follow_fp32(monkeypatch):
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    ref, ref_opt = _run(lambda groups: torch.optim.AdamW(groups, foreach=True, **kw))
    monkeypatch.setattr(adamw, "WORK_CHUNK_ELEMENTS", 6000)
    ours, opt = _run(lambda groups: adamw.AdamW(groups, **kw))

    def state_bytes(o):
        return sum(t.numel() * t.element_size() for s in o.state.values() for k, t in s.items() if k != "step")

    assert {s["exp_avg"].dtype for s in opt.state.values()} == {torch.bfloat16}
    assert state_bytes(opt) * 2 == state_bytes(ref_opt)
    start = _params()
    for p0, a, b in zip(start, ref, ours):
        moved = (a - p0).abs().max().item()
        assert moved > 1e-3
        # Ten steps of lr 1e-2 move each weight ~0.1; bf16 moments (8-bit mantissa) change that by < 1 %.
        assert (a - b).abs().max().item() < 0.01 * moved
        assert not torch.equal(a, b)


def test_build_optimizer_picks_it_by_state_dtype():
    model = torch.nn.Linear(4, 4)
    assert isinstance(build_optimizer(model, OptimConfig(state_dtype="bf16")), adamw.AdamW)
    assert type(build_optimizer(model, OptimConfig())) is torch.optim.AdamW


@pytest.mark.parametrize("overrides", [["optim.state_dtype=fp16"], ["optim.state_dtype=bf16", "optim.impl=fused"],
                                       ["optim.state_dtype=bf16", "optim.name=muon"]])
def test_state_dtypes_it_cannot_run_are_refused_in_one_line(overrides):
    err = refused("+recipe=cpu_smoke", *overrides)
    assert err.key == "optim.state_dtype" and "\n" not in str(err), str(err)


def test_the_estimate_halves_adams_state_and_an_offloaded_8b_fits_a_128_gib_host():
    from mfsdp_launch.mesh import ParallelDims
    from mfsdp_launch.planner import prepare
    from mfsdp_launch.planner.memory import GIB, estimate, host_bytes_per_node

    base = ["model=gpt", "model.preset=8b", "engine=fsdp2", "train.cpu_offload=true", "train.seq_len=8192",
            "train.micro_batch_size=1", "launcher.nproc_per_node=1", "launcher.dry_run=true"]
    def planned(overrides):
        cfg, _ = prepare(overrides, check_hardware=False)
        return cfg, ParallelDims.from_config(cfg.mesh, cfg.launcher.nproc_per_node)

    on_gpu = [estimate(*planned(base[:3] + base[4:] + extra)).optimizer for extra in ([], ["optim.state_dtype=bf16"])]
    assert on_gpu[1] * 2 == pytest.approx(on_gpu[0])
    host32, host16 = (host_bytes_per_node(*planned(base + extra)) / GIB for extra in ([], ["optim.state_dtype=bf16"]))
    assert host32 - host16 == pytest.approx(8.03e9 * 4 / GIB, rel=0.01)  # 4 bytes a parameter less
    assert host16 < 100 < 120 < host32


# ------------------------------------------------------------------------------------ FSDP2 + DCP


def _sharded(world: int, state_dtype: str):
    from mfsdp_launch.components.optim import build_scheduler

    engine, model = sharded_gpt(world)
    cfg = OptimConfig(lr=1e-2, warmup_steps=1, state_dtype=state_dtype)
    opt = build_optimizer(model, cfg)
    return engine, model, opt, build_scheduler(opt, cfg, STEPS)


def _manager(run: Path, world: int, rank: int, engine):
    return checkpoint_manager(run, world, rank, engine, interval=SAVE_AT, tag="adamw")


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def dp2_then_save(rank: int, world: int, workdir: str) -> None:
    from mfsdp_launch.components.optim import build_scheduler

    engine, model, opt, sched = _sharded(world, "bf16")
    ref = tiny_gpt()
    cfg = OptimConfig(lr=1e-2, warmup_steps=1, state_dtype="bf16")
    ref_opt = build_optimizer(ref, cfg)
    ref_sched = build_scheduler(ref_opt, cfg, STEPS)
    mgr = _manager(Path(workdir) / "run", world, rank, engine)
    assert mgr.resume(model, opt, sched, None) is None
    for step in range(1, STEPS + 1):
        _step(model, opt, sched, step, rank, world, grads_to=ref)  # the same gradients into both
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()
        # Elementwise on each shard: the sharded update is one process's, bf16 rounding included.
        assert _max_diff(engine.full_model_state_dict(model), ref.state_dict()) == 0.0, step
        mgr.maybe_save(step, model, opt, sched, None)
    state = next(iter(opt.state.values()))
    assert state["exp_avg"].dtype == torch.bfloat16 and type(state["exp_avg"]).__name__ == "DTensor"
    full = engine.full_model_state_dict(model)  # collective
    if rank == 0:
        torch.save(full, Path(workdir) / "dp2.pt")


def dp1_resume(workdir: str, state_dtype: str) -> dict:
    engine, model, opt, sched = _sharded(1, state_dtype)
    mgr = _manager(Path(workdir) / "run", 1, 0, engine)
    assert mgr.resume(model, opt, sched, None) == SAVE_AT
    moments = {str(s["exp_avg"].dtype) for s in opt.state.values()}
    assert moments == {f"torch.{'bfloat16' if state_dtype == 'bf16' else 'float32'}"}
    for step in range(SAVE_AT + 1, STEPS + 1):
        _step(model, opt, sched, step, 0, 1)
    return engine.full_model_state_dict(model)


def test_bf16_moments_shard_checkpoint_and_resume_at_another_world_size_and_dtype(tmp_path):
    run_ranks(dp2_then_save, 2, tmp_path, timeout=180)
    dp2 = torch.load(tmp_path / "dp2.pt")
    with one_rank_group(tmp_path / "store"):
        same = dp1_resume(str(tmp_path), "bf16")
    with one_rank_group(tmp_path / "store32"):
        wider = dp1_resume(str(tmp_path), "fp32")  # the saved bf16 moments, loaded into fp32 ones
    # dp=1 reduces no gradients: its sums differ from dp=2's in the last bits, and bf16 rounding of
    # the moments can amplify that to one bf16 step of a moment, far below the update itself.
    assert _max_diff(same, dp2) < 1e-4
    assert _max_diff(wider, dp2) < 1e-3


def test_fp32_moments_of_a_checkpoint_resume_as_bf16(tmp_path):
    with one_rank_group(tmp_path / "store"):
        engine, model, opt, sched = _sharded(1, "fp32")
        assert type(opt) is torch.optim.AdamW
        mgr = _manager(tmp_path / "run", 1, 0, engine)
        for step in range(1, SAVE_AT + 1):
            _step(model, opt, sched, step, 0, 1)
            mgr.maybe_save(step, model, opt, sched, None)
        saved = {n: opt.state[p]["exp_avg_sq"].full_tensor() for n, p in model.named_parameters()}
    with one_rank_group(tmp_path / "store2"):
        engine, model, opt, sched = _sharded(1, "bf16")
        assert _manager(tmp_path / "run", 1, 0, engine).resume(model, opt, sched, None) == SAVE_AT
        for n, p in model.named_parameters():
            got = opt.state[p]["exp_avg_sq"]
            assert got.dtype == torch.bfloat16 and torch.equal(got.full_tensor(), saved[n].bfloat16()), n
        _step(model, opt, sched, SAVE_AT + 1, 0, 1)  # and it steps on
