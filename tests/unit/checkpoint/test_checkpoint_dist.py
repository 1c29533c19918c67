"""Checkpoints with real gloo process groups, FSDP2 and DCP, in child processes.

The children are gloo ranks (helpers.run_ranks) running one SCENARIO of this file, each asserting
on its side; the tests check exit codes, printed decisions and the files left on disk.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest

from helpers import one_rank_group, rank_log, run_ranks, spawn_ranks


def _child(rank: int, world: int, scenario: str, workdir: str) -> None:
    SCENARIOS[scenario](rank, world, Path(workdir))


def _output(scenario: str, workdir: Path, rank: int = 0) -> str:
    return rank_log(workdir / scenario, rank).read_text()


def _spawn(scenario: str, world: int, workdir: Path):
    return spawn_ranks(_child, world, scenario, workdir, logs=workdir / scenario)


def _run(scenario: str, world: int, workdir: Path, timeout: float = 90) -> str:
    return run_ranks(_child, world, scenario, workdir, logs=workdir / scenario, timeout=timeout)[0]


def _run_here(scenario: str, workdir: Path, capsys) -> str:
    """A 1-rank scenario in this process, in a 1-rank gloo group (a child would only add a torch
    import); returns what it printed."""
    store = workdir / f"{scenario}.store"
    store.unlink(missing_ok=True)  # a file store left by an earlier group would be joined again
    capsys.readouterr()
    with one_rank_group(store):
        SCENARIOS[scenario](0, 1, workdir)
    return capsys.readouterr().out


# =============================================================================== child side


class _TrainState:
    def __init__(self):
        self.step, self.tokens_seen, self.consumed_samples = 0, 0, 0

    def state_dict(self):
        return {"step": self.step, "tokens_seen": self.tokens_seen, "consumed_samples": self.consumed_samples}

    def load_state_dict(self, d):
        self.step, self.tokens_seen, self.consumed_samples = d["step"], d["tokens_seen"], d["consumed_samples"]


def _tiny_mlp():
    import torch.nn as nn

    class TinyMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(8, 16)
            self.fc2 = nn.Linear(16, 5)  # 5 rows: uneven shards over 2 ranks

        def forward(self, x):
            return self.fc2(self.fc1(x).relu())

    return TinyMLP()


def _build(world: int, seed: int):
    from types import SimpleNamespace

    import torch
    import torch.nn as nn

    from mfsdp_launch.engines.fsdp2 import FSDP2Engine
    from mfsdp_launch.mesh import ParallelDims
    from mfsdp_launch.core.schema import EngineConfig, PrecisionConfig, ShardingConfig
    from mfsdp_launch.core.sharding import ZeroStrategy

    dims = ParallelDims(1, world, 1, 1)
    mesh = dims.build("cpu")
    torch.manual_seed(seed)
    model = _tiny_mlp()
    engine = FSDP2Engine(engine_cfg=EngineConfig(), sharding_cfg=ShardingConfig(zero_dp_strategy=ZeroStrategy.optim_grads_params),
                         precision_cfg=PrecisionConfig(compute_dtype="fp32"), dims=dims, mesh=mesh,
                         device=torch.device("cpu"))
    spec = SimpleNamespace(unit_modules=(nn.Linear,), init_weights=lambda m: None)
    model = engine.shard(model, spec, init_on_meta=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return engine, model, opt, sched, _TrainState()


def _info(world: int) -> dict:
    return {"config_hash": "test", "model": {"name": "tiny_mlp", "shape": {"in": 8, "hidden": 16, "out": 5}},
            "mesh": {"dp_shard": world, "world_size": world}, "engine": {"name": "fsdp2"},
            "versions": {}, "seed": 7}


def _manager(run_dir: Path, world: int, rank: int, engine, **ck):
    import torch.distributed as dist

    from mfsdp_launch.checkpoint import CheckpointManager
    from mfsdp_launch.core.schema import CheckpointConfig

    return CheckpointManager(CheckpointConfig(**ck), run_dir, manifest_info=_info(world), rank=rank,
                             world_size=world, engine=engine, process_group=dist.new_group(backend="gloo"))


def _train_step(model, opt, sched, ts, step: int, rank: int, world: int) -> float:
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 8, generator=g)
    noise = torch.rand(()).item()  # global RNG: a resume must restore it to continue identically
    loss = (model(x) ** 2).mean() * (1 + noise)
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    ts.step, ts.consumed_samples, ts.tokens_seen = step, ts.consumed_samples + 4 * world, ts.tokens_seen + 32 * world
    return loss.item()


def _local_state(engine, model, opt) -> dict:
    """Flat {key: local tensor/value} copy of the sharded model + optimizer state."""
    from torch.distributed.tensor import DTensor

    out = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}{k}.", x)
        elif isinstance(v, DTensor):
            out[prefix[:-1]] = v.to_local().detach().clone()
        elif hasattr(v, "detach"):
            out[prefix[:-1]] = v.detach().clone()
        elif isinstance(v, (list, tuple)):
            out[prefix[:-1]] = list(v)
        else:
            out[prefix[:-1]] = v

    walk("", engine.state_dict(model, opt))
    return out


def _full_state(engine, model, opt) -> dict:
    """Unsharded model weights and optimizer moments (collective)."""
    from torch.distributed.tensor import DTensor

    full = {"model": engine.full_model_state_dict(model), "optim": {}}
    osd = engine.state_dict(model, opt)["optimizer"]
    for fqn, st in sorted(osd["state"].items()):
        for k, v in sorted(st.items()):
            full["optim"][f"{fqn}.{k}"] = v.full_tensor() if isinstance(v, DTensor) else v.clone()
    return full


def _assert_same(a: dict, b: dict, what: str):
    import torch

    assert set(a) == set(b), f"{what}: keys differ: {set(a) ^ set(b)}"
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f"{what}: {k} differs"
        else:
            assert x == y, f"{what}: {k}: {x!r} != {y!r}"


def scenario_main(rank: int, world: int, workdir: Path):
    """Sync saves, keep_last, skip of a duplicate final save, async save, identical 2->2 resume."""
    import torch

    from mfsdp_launch.checkpoint import inspect_checkpoint

    run = workdir / "run"
    engine, model, opt, sched, ts = _build(world, seed=0)
    mgr = _manager(run, world, rank, engine, interval=2, keep_last=2)
    assert mgr.resume(model, opt, sched, ts) is None
    for step in range(1, 5):
        _train_step(model, opt, sched, ts, step, rank, world)
        mgr.maybe_save(step, model, opt, sched, ts)
    ck = run / "checkpoints"
    assert inspect_checkpoint(ck / "step_4")[1] is None and inspect_checkpoint(ck / "step_2")[1] is None
    t4 = json.loads((ck / "step_4" / "manifest.json").read_text())["saved_at_unix"]
    mgr.maybe_save(4, model, opt, sched, ts, final=True)  # already committed: skipped
    assert json.loads((ck / "step_4" / "manifest.json").read_text())["saved_at_unix"] == t4

    # Async: the state at step 6 is what lands on disk although training goes on meanwhile.
    amgr = _manager(run, world, rank, engine, interval=2, keep_last=2, async_save=True)
    assert amgr.resume(model, opt, sched, ts) == 4
    for step in (5, 6):
        _train_step(model, opt, sched, ts, step, rank, world)
        amgr.maybe_save(step, model, opt, sched, ts)
    snap6 = _local_state(engine, model, opt)
    sched6, ts6 = sched.state_dict(), ts.state_dict()
    full6 = _full_state(engine, model, opt)
    rng6 = torch.get_rng_state()
    if rank == 0:
        torch.save(full6, workdir / "full6.pt")
    loss7 = _train_step(model, opt, sched, ts, 7, rank, world)
    blocked7 = amgr.maybe_save(7, model, opt, sched, ts)
    amgr.wait()
    assert amgr._pending is None
    assert inspect_checkpoint(ck / "step_6")[1] is None, "async save not committed"
    assert (ck / "latest").read_text().strip() == "step_6"
    manifest = json.loads((ck / "step_6" / "manifest.json").read_text())
    assert manifest["async"] is True and manifest["world_size"] == world
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_4", "step_6"], list(ck.iterdir())
    assert amgr.last_save_seconds > 0 and amgr.last_blocked_seconds == blocked7

    # Fresh model/optimizer (other seed) resume: identical state, identical next step.
    torch.manual_seed(123)
    engine2, model2, opt2, sched2, ts2 = _build(world, seed=99)
    mgr2 = _manager(run, world, rank, engine2, interval=2, keep_last=2)
    assert mgr2.resume(model2, opt2, sched2, ts2) == 6
    _assert_same(_local_state(engine2, model2, opt2), snap6, "model+optimizer")
    assert sched2.state_dict() == sched6, (sched2.state_dict(), sched6)
    assert ts2.state_dict() == ts6
    assert torch.equal(torch.get_rng_state(), rng6)
    assert _train_step(model2, opt2, sched2, ts2, 7, rank, world) == loss7


def scenario_load1(rank: int, world: int, workdir: Path):
    """A 2-rank checkpoint loaded by 1 rank: DCP reshards; full weights and moments identical."""
    import torch

    engine, model, opt, sched, ts = _build(world, seed=5)
    mgr = _manager(workdir / "run", world, rank, engine, interval=2, keep_last=2)
    assert mgr.resume(model, opt, sched, ts) == 6
    ref = torch.load(workdir / "full6.pt", weights_only=True)
    full = _full_state(engine, model, opt)
    _assert_same(full["model"], ref["model"], "full weights")
    _assert_same(full["optim"], ref["optim"], "optimizer moments")
    assert ts.step == 6 and ts.consumed_samples == 6 * 4 * 2
    # Save this 1-rank state for the 1 -> 2 test.
    _train_step(model, opt, sched, ts, 7, rank, world)
    mgr1 = _manager(workdir / "run1", world, rank, engine, interval=0)
    assert mgr1.resume(model, opt, sched, ts) is None
    mgr1.maybe_save(7, model, opt, sched, ts, final=True)
    torch.save(_full_state(engine, model, opt), workdir / "full7.pt")


def scenario_grow(rank: int, world: int, workdir: Path):
    """1 -> 2 ranks: resharded state identical; rank 1 has no saved RNG state and seeds itself."""
    import torch

    from mfsdp_launch.components.rng import fallback_seed

    engine, model, opt, sched, ts = _build(world, seed=11)
    mgr = _manager(workdir / "run1", world, rank, engine, interval=0)
    assert mgr.resume(model, opt, sched, ts) == 7
    ref = torch.load(workdir / "full7.pt", weights_only=True)
    full = _full_state(engine, model, opt)
    _assert_same(full["model"], ref["model"], "full weights")
    _assert_same(full["optim"], ref["optim"], "optimizer moments")
    if rank == 1:
        expect = torch.Generator().manual_seed(fallback_seed(7, 1, 7)).get_state()
        assert torch.equal(torch.get_rng_state(), expect)


def scenario_crash(rank: int, world: int, workdir: Path):
    """Commit step 10, then hang inside step 20's DCP write on rank 1 (the test SIGKILLs it)."""
    from torch.distributed.checkpoint import filesystem

    run = workdir / "crash"
    engine, model, opt, sched, ts = _build(world, seed=0)
    mgr = _manager(run, world, rank, engine, interval=10, keep_last=3)
    mgr.resume(model, opt, sched, ts)
    for step in range(1, 21):
        if step == 20 and rank == 1:
            original = filesystem.FileSystemWriter.write_data

            def slow_write(self, plan, planner):
                (workdir / "rank1_writing").touch()
                time.sleep(120)
                return original(self, plan, planner)

            filesystem.FileSystemWriter.write_data = slow_write
        _train_step(model, opt, sched, ts, step, rank, world)
        mgr.maybe_save(step, model, opt, sched, ts)
    raise AssertionError("the save of step 20 should have been killed")


def scenario_after_crash(rank: int, world: int, workdir: Path):
    engine, model, opt, sched, ts = _build(world, seed=3)
    mgr = _manager(workdir / "crash", world, rank, engine, interval=10, keep_last=3)
    assert not list((workdir / "crash" / "checkpoints").glob("*.tmp")), "stale .tmp not cleaned"
    assert mgr.resume(model, opt, sched, ts) == 10
    assert ts.step == 10


SCENARIOS = {"main": scenario_main, "load1": scenario_load1, "grow": scenario_grow, "crash": scenario_crash,
             "after_crash": scenario_after_crash}


# =============================================================================== tests

@pytest.fixture(scope="module")
def main_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ckpt_dist")
    out = _run("main", 2, workdir)
    return workdir, out

def test_save_resume_same_world_size_identical(main_run):
    workdir, out = main_run
    assert "starting fresh: no checkpoint in" in out
    assert "resuming from step 4 (" in out
    assert f"resuming from step 6 ({workdir / 'run' / 'checkpoints' / 'step_6'})" in out

def test_async_save_commits(main_run):
    workdir, out = main_run
    manifest = json.loads((workdir / "run" / "checkpoints" / "step_6" / "manifest.json").read_text())
    assert manifest["async"] is True
    names = {f["path"] for f in manifest["files"]}
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "extra_rank0.pt", "extra_rank1.pt",
            "trainer.json"} <= names
    # Each rank hashed its own files in the writer's thread; all of them are recorded and match.
    from mfsdp_launch.checkpoint import verify_checksums

    assert all(e["checksum"].startswith("xxh3_64:") for e in manifest["files"])
    assert verify_checksums(workdir / "run" / "checkpoints" / "step_6", manifest) is None
    assert re.search(r"checkpoint step_6 committed \([\d.]+ MB, [\d.]+ s, async\)", out), out

def test_resume_at_another_world_size_reshards(main_run, capsys):
    workdir, _ = main_run
    out = _run_here("load1", workdir, capsys)
    assert "resuming from step 6" in out
    assert "world size 2 -> 1" in out

def test_resume_at_a_larger_world_size(main_run, capsys):
    workdir, _ = main_run
    if not (workdir / "full7.pt").exists():
        _run_here("load1", workdir, capsys)
    out = _run("grow", 2, workdir)
    assert "resuming from step 7" in out and "world size 1 -> 2" in out
    assert "ranks 1..1 have no saved RNG state" in out

def test_export_matches_unwrapped_state_dict(main_run, tmp_path, capsys):
    import torch

    from mfsdp_launch.tools.export import main as export_main

    load_file = pytest.importorskip("safetensors.torch").load_file

    workdir, _ = main_run
    ref = torch.load(workdir / "full6.pt", weights_only=True)["model"]
    out = tmp_path / "model.safetensors"
    assert export_main([str(workdir / "run"), str(out), "--dtype", "bf16"]) == 0
    tensors = load_file(str(out))
    assert set(tensors) == set(_tiny_mlp().state_dict())
    for k, t in tensors.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, ref[k].to(torch.bfloat16))
    out_pt = tmp_path / "model.pt"
    assert export_main([str(workdir / "run" / "checkpoints" / "step_4"), str(out_pt), "--format", "torch"]) == 0
    m = _tiny_mlp()
    m.load_state_dict(torch.load(out_pt, weights_only=True))  # strict: keys and shapes match
    capsys.readouterr()
    assert export_main([str(tmp_path / "nope"), str(tmp_path / "x.safetensors")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not exist" in err[0]

def test_saved_model_keys_strips_prefixes_and_refuses_collisions(tmp_path):
    from types import SimpleNamespace

    from mfsdp_launch.checkpoint import saved_model_keys
    from mfsdp_launch.core.errors import ConfigError

    md = SimpleNamespace(state_dict_metadata=dict.fromkeys(
        ["model.module.w", "model._orig_mod.b", "optimizer.state.module.w"]))
    assert saved_model_keys(md, path=tmp_path, key="k") == {"w": "module.w", "b": "_orig_mod.b"}
    md.state_dict_metadata["model.w"] = None
    with pytest.raises(ConfigError) as e:
        saved_model_keys(md, path=tmp_path, key="checkpoint.load_path")
    assert str(e.value) == f"checkpoint.load_path: {tmp_path}: keys 'w' and another both map to 'w'"

def test_sigkill_mid_save_leaves_previous_checkpoint(tmp_path, capsys):
    procs = _spawn("crash", 2, tmp_path)
    marker = tmp_path / "rank1_writing"
    deadline = time.time() + 60
    try:
        while not marker.exists():
            assert time.time() < deadline, "save of step 20 never started:\n" + _output("crash", tmp_path)
            assert all(p.poll() is None for p in procs), _output("crash", tmp_path, 0) + _output("crash", tmp_path, 1)
            time.sleep(0.05)
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(timeout=10)
    finally:
        time.sleep(0.3)
        for p in procs:  # rank 0 now hangs in a collective: the launcher would tear it down
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
    ck = tmp_path / "crash" / "checkpoints"
    assert (ck / "step_10" / "manifest.json").is_file()
    assert not (ck / "step_20").exists()
    assert (ck / "step_20.tmp").is_dir()
    assert (ck / "latest").read_text().strip() == "step_10"
    out = _run_here("after_crash", tmp_path, capsys)
    assert f"resuming from step 10 ({ck / 'step_10'})" in out
    assert not (ck / "step_20.tmp").exists()

def test_failed_save_keeps_previous_checkpoints(tmp_path, monkeypatch):
    """A write that fails inside DCP (which then raises its CheckpointException, a BaseException):
    .tmp removed, committed checkpoints intact, one clear error; the next save works."""
    import torch
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    from mfsdp_launch.checkpoint import CheckpointError, CheckpointManager, committed_steps
    from mfsdp_launch.engines.fsdp2 import FSDP2Engine
    from mfsdp_launch.core.schema import CheckpointConfig

    model = _tiny_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine = FSDP2Engine(engine_cfg=None, sharding_cfg=None, precision_cfg=None, dims=None, mesh=None,
                         device=torch.device("cpu"))
    ts = _TrainState()
    mgr = CheckpointManager(CheckpointConfig(interval=1, keep_last=5), tmp_path, manifest_info=_info(1),
                            rank=0, world_size=1, engine=engine)
    assert mgr.resume(model, opt, None, ts) is None
    mgr.maybe_save(1, model, opt, None, ts)
    assert committed_steps(tmp_path / "checkpoints") == [1]

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    with pytest.raises(CheckpointError, match=r"step 2 failed \(rank 0: OSError: \[Errno 28\] No space left.*"
                                              r"intact: step_1$"):
        mgr.maybe_save(2, model, opt, None, ts)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_1"]
    monkeypatch.undo()
    mgr.maybe_save(2, model, opt, None, ts)  # retried at the next opportunity: works
    assert committed_steps(tmp_path / "checkpoints") == [1, 2]

# ------------------------------------------------------------------ single process, no group

def _plain_setup(run_dir, lr=1e-2, wrap=False, **ck):
    import torch
    import torch.nn as nn

    from mfsdp_launch.checkpoint import CheckpointManager
    from mfsdp_launch.engines.fsdp2 import FSDP2Engine
    from mfsdp_launch.core.schema import CheckpointConfig

    model = _tiny_mlp()
    if wrap:  # another engine's naming: every key gets a "module." prefix
        inner, model = model, nn.Module()
        model.module = inner
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    engine = FSDP2Engine(engine_cfg=None, sharding_cfg=None, precision_cfg=None, dims=None, mesh=None,
                         device=torch.device("cpu"))
    mgr = CheckpointManager(CheckpointConfig(**ck), run_dir, manifest_info=_info(1), rank=0,
                            world_size=1, engine=engine)
    return model, opt, sched, _TrainState(), mgr

def _steps(model, opt, sched, ts, mgr, steps, **kw):
    import torch

    for step in steps:
        x = torch.randn(4, 8)
        (model(x) if hasattr(model, "fc1") else model.module(x)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        ts.step = step
        mgr.maybe_save(step, model, opt, sched, ts, **kw)

def test_load_step_rewinds_and_replaces_later_steps(tmp_path, capsys):
    from mfsdp_launch.checkpoint import committed_steps

    model, opt, sched, ts, mgr = _plain_setup(tmp_path, interval=1, keep_last=5)
    mgr.resume(model, opt, sched, ts)
    _steps(model, opt, sched, ts, mgr, range(1, 4))
    assert committed_steps(tmp_path / "checkpoints") == [1, 2, 3]
    model, opt, sched, ts, mgr = _plain_setup(tmp_path, interval=1, keep_last=5, load_step=1)
    assert mgr.resume(model, opt, sched, ts) == 1
    out = capsys.readouterr().out
    assert "step_2, step_3 in" in out and "resuming from step 1 (" in out
    _steps(model, opt, sched, ts, mgr, [2])
    assert committed_steps(tmp_path / "checkpoints") == [1, 2]
    # The replaced timeline's step_2 and step_3 are kept aside, not deleted.
    assert committed_steps(tmp_path / "previous" / "1" / "checkpoints") == [2, 3]
    out = capsys.readouterr().out
    assert f"moved the earlier step_2, step_3 to {tmp_path / 'previous' / '1'}" in out
    assert "it continued from step_1" in out and "nothing is deleted" in out
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_2"

def test_weights_only_load_across_key_prefixes(tmp_path, capsys):
    src, opt, sched, ts, mgr = _plain_setup(tmp_path / "pre", wrap=True, interval=0)
    mgr.resume(src, opt, sched, ts)
    _steps(src, opt, sched, ts, mgr, [5], final=True)
    model, opt, sched, ts, mgr = _plain_setup(tmp_path / "ft", interval=0, load_path=str(tmp_path / "pre"),
                                              load_weights_only=True)
    assert mgr.resume(model, opt, sched, ts) == 0
    assert "starting fresh from the model weights of step 5" in capsys.readouterr().out
    _assert_same(model.state_dict(), src.module.state_dict(), "weights")
    assert not opt.state and ts.step == 0 and sched.last_epoch == 0

def test_lr_change_takes_effect_on_resume(tmp_path, capsys):
    model, opt, sched, ts, mgr = _plain_setup(tmp_path, lr=1e-2, interval=3)
    mgr.resume(model, opt, sched, ts)
    _steps(model, opt, sched, ts, mgr, range(1, 4))
    saved_lr = opt.param_groups[0]["lr"]
    model, opt, sched, ts, mgr = _plain_setup(tmp_path, lr=1e-2, interval=3)
    assert mgr.resume(model, opt, sched, ts) == 3
    assert opt.param_groups[0]["lr"] == saved_lr == 1e-2 / 4  # unchanged config: identical
    model, opt, sched, ts, mgr = _plain_setup(tmp_path, lr=4e-2, interval=3)
    capsys.readouterr()
    assert mgr.resume(model, opt, sched, ts) == 3
    assert "base LR [0.01] in the checkpoint -> [0.04] from the config" in capsys.readouterr().out
    assert sched.base_lrs == [4e-2] and opt.param_groups[0]["lr"] == 4e-2 / 4 and sched.last_epoch == 3
    assert opt.state  # the optimizer state was loaded
