"""optim.name=muon on real FSDP2 (gloo ranks in child processes) and real DCP: a sharded step equals
the single-process Muon to 1e-6, and a checkpoint saved at dp=2 resumes at dp=1 and continues
like the dp=2 run (momentum, AdamW moments and the WSD schedule restored through DCP)."""

from __future__ import annotations

from pathlib import Path

from helpers import one_rank_group, run_ranks
from sharded_optim import checkpoint_manager, sharded_gpt, tiny_gpt, train_step as _step

STEPS, SAVE_AT = 5, 3
TOL = 1e-6


def _optim_cfg():
    from mfsdp_launch.core.schema import OptimConfig

    return OptimConfig(name="muon", lr=0.02, weight_decay=0.1, warmup_steps=1, schedule="wsd", decay_fraction=0.6)


def _sharded(world: int):
    from mfsdp_launch.components.optim import build_optimizer, build_scheduler

    engine, model = sharded_gpt(world)
    opt = build_optimizer(model, _optim_cfg())
    return engine, model, opt, build_scheduler(opt, _optim_cfg(), STEPS)


def _manager(run: Path, world: int, rank: int, engine):
    return checkpoint_manager(run, world, rank, engine, interval=SAVE_AT, tag="muon")


def _assert_close(full: dict, ref: dict, what: str) -> None:
    import torch

    assert set(full) == set(ref), what
    worst = max((full[k] - ref[k]).abs().max().item() for k in full)
    assert worst <= TOL, f"{what}: max |difference| {worst:.3g} > {TOL}"
    assert any(not torch.equal(full[k], v) for k, v in tiny_gpt().state_dict().items()), f"{what}: nothing moved"


def dp2_then_save(rank: int, world: int, workdir: str) -> None:
    import torch

    from mfsdp_launch.components.muon import Muon
    from mfsdp_launch.components.optim import build_optimizer, build_scheduler

    engine, model, opt, sched = _sharded(world)
    assert isinstance(opt, Muon) and [g["muon"] for g in opt.param_groups] == [True, False, False]
    # Embedding and head go to AdamW: the Muon group holds the blocks' matrices only.
    assert len(opt.param_groups[0]["params"]) == 4 * 2  # wqkv, wo, w_gate_up, w_down per block
    ref = tiny_gpt()
    ref_opt = build_optimizer(ref, _optim_cfg())
    ref_sched = build_scheduler(ref_opt, _optim_cfg(), STEPS)
    mgr = _manager(Path(workdir) / "run", world, rank, engine)
    assert mgr.resume(model, opt, sched, None) is None
    for step in range(1, STEPS + 1):
        # The same gradients into both: the reduce-scatter's sums differ from one process's in the last
        # bits, and AdamW's first step (g / (|g| + eps)) magnifies that where g is near 0.
        _step(model, opt, sched, step, rank, world, grads_to=ref)
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()
        _assert_close(engine.full_model_state_dict(model), ref.state_dict(), f"dp=2 step {step} vs one process")
        mgr.maybe_save(step, model, opt, sched, None)
    full = engine.full_model_state_dict(model)  # collective
    if rank == 0:
        torch.save({"model": full, "lr": opt.param_groups[0]["lr"]}, Path(workdir) / "dp2.pt")


def dp1_resume(rank: int, world: int, workdir: str) -> None:
    import torch

    engine, model, opt, sched = _sharded(world)
    mgr = _manager(Path(workdir) / "run", world, rank, engine)
    assert mgr.resume(model, opt, sched, None) == SAVE_AT
    for step in range(SAVE_AT + 1, STEPS + 1):
        _step(model, opt, sched, step, rank, world)
    dp2 = torch.load(Path(workdir) / "dp2.pt")
    assert opt.param_groups[0]["lr"] == dp2["lr"]
    _assert_close(engine.full_model_state_dict(model), dp2["model"], "dp=1 resume vs dp=2")


def test_muon_sharded_step_matches_one_process_and_resumes_at_another_world_size(tmp_path, capsys):
    run_ranks(dp2_then_save, 2, tmp_path, timeout=180)
    assert (tmp_path / "run" / "checkpoints" / f"step_{SAVE_AT}" / "manifest.json").is_file()
    with one_rank_group(tmp_path / "store"):  # dp=1 in this process: one torch start-up less
        dp1_resume(0, 1, str(tmp_path))
    assert f"resuming from step {SAVE_AT}" in capsys.readouterr().out
