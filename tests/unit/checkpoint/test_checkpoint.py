"""Unit tests of the pure-Python side of mfsdp_launch.checkpoint: finding, validating and pruning
checkpoints, the resume decision and the launcher's preflight. No torch, no processes (but one)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from helpers import cli_env
from mfsdp_launch import checkpoint as C
from mfsdp_launch.core.errors import ConfigError
from mfsdp_launch.core.schema import CheckpointConfig
from mfsdp_launch.planner.compose import typed_schema


def make_ckpt(ckpt_dir: Path, step: int, *, manifest: dict | None = None, ranks: int = 2,
              commit: bool = True) -> Path:
    """A fake committed checkpoint: DCP-like files plus a manifest listing them."""
    d = ckpt_dir / (C.step_name(step) + ("" if commit else C.TMP_SUFFIX))
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"m" * 10)
    for r in range(ranks):
        (d / f"__{r}_0.distcp").write_bytes(b"x" * (100 + r))
        (d / f"extra_rank{r}.pt").write_bytes(b"e")
    (d / "trainer.json").write_text(json.dumps({"step": step}))
    if commit:
        body = dict(manifest or {})
        body.update(step=step, files=C.list_files(d))
        (d / C.MANIFEST).write_text(json.dumps(body))
        (ckpt_dir / C.LATEST).write_text(d.name + "\n")
    return d


def make_cfg(run_dir: Path, **overrides):
    """The typed config (the model family's section) with `overrides` (dotted keys) applied."""
    cfg = typed_schema({"model": {"name": overrides.get("model.name", "gpt")},
                        "engine": {"name": overrides.get("engine.name", "fsdp2")}})
    cfg.run.dir = str(run_dir)
    for key, value in overrides.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def info_of(cfg) -> dict:
    return C.manifest_info_from_config(cfg, versions={})


# ----------------------------------------------------------------------- finding the latest


def test_latest_ignores_tmp_and_manifestless_and_dangling_pointer(tmp_path):
    ck = tmp_path / "checkpoints"
    make_ckpt(ck, 10)
    make_ckpt(ck, 20)
    make_ckpt(ck, 30, commit=False)  # step_30.tmp: a save in progress
    (ck / "step_40").mkdir()  # no manifest
    (ck / "step_40" / "__0_0.distcp").write_bytes(b"x")
    (ck / C.LATEST).write_text("step_50\n")  # points to a deleted directory
    found, damaged = C.find_latest(ck)
    assert found.step == 20 and found.path == ck / "step_20"
    assert [(p.name, why) for p, why in damaged] == [("step_40", "missing manifest.json")]
    assert C.committed_steps(ck) == [10, 20]
    assert [p.name for p in C.stale_tmp_entries(ck)] == ["step_30.tmp"]


def test_latest_pointer_lagging_behind_is_not_trusted(tmp_path):
    ck = tmp_path / "checkpoints"
    make_ckpt(ck, 10)
    make_ckpt(ck, 20)
    (ck / C.LATEST).write_text("step_10\n")  # crash between the rename and the pointer update
    assert C.find_latest(ck)[0].step == 20
    assert C.read_latest_pointer(ck) == "step_10"


def test_no_checkpoint_dir(tmp_path):
    assert C.find_latest(tmp_path / "nothing") == (None, [])
    assert C.list_step_dirs(tmp_path / "nothing") == []


@pytest.mark.parametrize("damage, why", [
    ("missing_shard", "missing __1_0.distcp"),
    ("truncated_shard", "__0_0.distcp has 3 bytes, the manifest says 100"),
    ("garbage_manifest", "unreadable manifest.json (JSONDecodeError)"),
    ("wrong_step", "manifest.json says step 7"),
    ("no_files", "manifest.json lacks step/files"),
])
def test_damage_detected(tmp_path, damage, why):
    d = make_ckpt(tmp_path, 20)
    m = json.loads((d / C.MANIFEST).read_text())
    if damage == "missing_shard":
        (d / "__1_0.distcp").unlink()
    elif damage == "truncated_shard":
        (d / "__0_0.distcp").write_bytes(b"xxx")
    elif damage == "garbage_manifest":
        (d / C.MANIFEST).write_text('{"step": 20, "files": [')
    elif damage == "wrong_step":
        (d / C.MANIFEST).write_text(json.dumps(dict(m, step=7)))
    elif damage == "no_files":
        (d / C.MANIFEST).write_text(json.dumps({"step": 20}))
    manifest, problem = C.inspect_checkpoint(d)
    assert manifest is None and problem == why


def test_intact_checkpoint_passes(tmp_path):
    d = make_ckpt(tmp_path, 5)
    manifest, problem = C.inspect_checkpoint(d)
    assert problem is None and manifest["step"] == 5


# ----------------------------------------------------------------------- pruning


def _entries(steps, damaged=()):
    return [(s, Path(f"step_{s}"), s not in damaged) for s in steps]


def test_prune_keeps_newest_k():
    assert C.prune_plan(_entries([10, 20, 30, 40, 50]), 2, []) == [Path("step_30"), Path("step_20"), Path("step_10")]
    assert C.prune_plan(_entries([10, 20]), 3, []) == []


def test_prune_never_deletes_resumed_from_or_newest():
    plan = C.prune_plan(_entries([10, 20, 30, 40]), 1, [Path("step_20")])
    assert Path("step_40") not in plan and Path("step_20") not in plan
    assert sorted(plan) == [Path("step_10"), Path("step_30")]
    assert C.prune_plan(_entries([10]), 0, []) == []  # keep_last < 1 still keeps the newest


def test_prune_counts_only_intact_and_keeps_newer_damaged():
    # step_50 damaged: not counted; the 2 newest intact are 40 and 30.
    plan = C.prune_plan(_entries([10, 20, 30, 40, 50], damaged={50}), 2, [])
    assert plan == [Path("step_20"), Path("step_10")]


# ----------------------------------------------------------------------- the resume decision


def test_plan_fresh_and_never(tmp_path):
    ck = tmp_path / "checkpoints"
    plan = C.plan_resume(CheckpointConfig(), ck)
    assert plan.kind == "fresh" and plan.line == f"starting fresh: no checkpoint in {ck}"
    make_ckpt(ck, 10)
    # Starting over would replace step_10: refused, unless checkpoint.overwrite=true says so.
    with pytest.raises(ConfigError) as e:
        C.plan_resume(CheckpointConfig(resume="never"), ck)
    assert e.value.key == "checkpoint.resume" and "step_10" in e.value.problem
    assert "overwrite=true" in e.value.allowed and "nothing is deleted" in e.value.allowed
    plan = C.plan_resume(CheckpointConfig(resume="never", overwrite=True), ck)
    assert plan.kind == "fresh" and plan.line == "starting fresh: checkpoint.resume=never"


def test_plan_falls_back_past_damaged(tmp_path):
    ck = tmp_path / "checkpoints"
    make_ckpt(ck, 10)
    (make_ckpt(ck, 20) / "__1_0.distcp").unlink()
    plan = C.plan_resume(CheckpointConfig(), ck)
    assert plan.kind == "resume" and plan.step == 10
    assert plan.notes == ["step_20 is damaged (missing __1_0.distcp), falling back to step_10"]
    assert plan.line == f"resuming from step 10 ({ck / 'step_10'})"


def test_plan_skips_steps_a_checksum_found_damaged(tmp_path):
    """`damaged`: what the workers' checksum verification found; sizes alone look fine."""
    ck = tmp_path / "checkpoints"
    make_ckpt(ck, 10)
    make_ckpt(ck, 20)
    bad = {ck / "step_20": "checksum mismatch in __0_0.distcp"}
    plan = C.plan_resume(CheckpointConfig(), ck, bad)
    assert plan.step == 10
    assert plan.notes == ["step_20 is damaged (checksum mismatch in __0_0.distcp), falling back to step_10"]
    other = tmp_path / "new" / "checkpoints"
    plan = C.plan_resume(CheckpointConfig(load_path=str(tmp_path)), other, bad)
    assert plan.step == 10 and not plan.own
    assert plan.notes == [f"step_20 of {ck} is damaged (checksum mismatch in __0_0.distcp), falling back to step_10"]
    with pytest.raises(ConfigError) as e:
        C.plan_resume(CheckpointConfig(load_step=20), ck, bad)
    assert "step_20 exists but is damaged (checksum mismatch in __0_0.distcp); committed steps in" in str(e.value)
    with pytest.raises(ConfigError) as e:
        C.plan_resume(CheckpointConfig(), ck, {ck / "step_20": "a", ck / "step_10": "b"})
    assert str(e.value).startswith(f"checkpoint.resume: auto, but {ck} has no intact checkpoint: "
                                   "step_20 is damaged (a); step_10 is damaged (b)")


def test_plan_refuses_when_all_damaged(tmp_path):
    ck = tmp_path / "checkpoints"
    (make_ckpt(ck, 20) / C.MANIFEST).write_text("nope")
    with pytest.raises(ConfigError) as e:
        C.plan_resume(CheckpointConfig(), ck)
    assert e.value.key == "checkpoint.resume" and "step_20 is damaged" in str(e.value)


def test_plan_load_path_only_without_own_checkpoint(tmp_path):
    other = tmp_path / "pretrain"
    make_ckpt(other / "checkpoints", 100)
    ck = tmp_path / "run" / "checkpoints"
    cfg = CheckpointConfig(load_path=str(other), load_weights_only=True)
    plan = C.plan_resume(cfg, ck)
    assert plan.kind == "weights" and plan.step == 100 and not plan.own
    assert plan.line.startswith("starting fresh from the model weights of step 100")
    make_ckpt(ck, 30)  # the fine-tune was preempted: its own progress wins
    plan = C.plan_resume(cfg, ck)
    assert plan.kind == "resume" and plan.step == 30 and plan.own
    assert "is not used" in plan.notes[0]


def test_plan_load_path_forms(tmp_path):
    d = make_ckpt(tmp_path / "checkpoints", 7)
    for form in (tmp_path, tmp_path / "checkpoints", d):
        assert C.resolve_checkpoint(form).path == d
    with pytest.raises(ConfigError, match="is step 7"):
        C.resolve_checkpoint(d, step=8)


def test_plan_load_step_own_notes_later_steps(tmp_path):
    ck = tmp_path / "checkpoints"
    for s in (10, 20, 30):
        make_ckpt(ck, s)
    plan = C.plan_resume(CheckpointConfig(load_step=10), ck)
    assert plan.step == 10 and plan.own
    assert "step_20, step_30" in plan.notes[0] and "moves them to" in plan.notes[0]
    assert "nothing is deleted" in plan.notes[0]


# ----------------------------------------------------------------------- preflight


def test_preflight_must_on_empty_dir(tmp_path):
    with pytest.raises(ConfigError) as e:
        C.preflight(make_cfg(tmp_path, **{"checkpoint.resume": "must"}))
    assert e.value.key == "checkpoint.resume"
    assert f"must, but {tmp_path / 'checkpoints'} has no committed checkpoint" in str(e.value)


def test_preflight_load_step_missing_lists_available(tmp_path):
    ck = tmp_path / "checkpoints"
    make_ckpt(ck, 10)
    make_ckpt(ck, 20)
    with pytest.raises(ConfigError) as e:
        C.preflight(make_cfg(tmp_path, **{"checkpoint.load_step": 15}))
    msg = str(e.value)
    assert e.value.key == "checkpoint.load_step"
    assert str(ck / "step_15") in msg and "does not exist" in msg and "10, 20" in msg


def test_preflight_load_step_damaged_or_uncommitted(tmp_path):
    ck = tmp_path / "checkpoints"
    make_ckpt(ck, 10)
    (make_ckpt(ck, 20) / "__0_0.distcp").unlink()
    make_ckpt(ck, 30, commit=False)
    with pytest.raises(ConfigError) as e:
        C.preflight(make_cfg(tmp_path, **{"checkpoint.load_step": 20}))
    assert f"{ck / 'step_20'} exists but is damaged (missing __0_0.distcp)" in str(e.value)
    assert f"; committed steps in {ck}: 10 (allowed: 10)" in str(e.value)
    with pytest.raises(ConfigError) as e:
        C.preflight(make_cfg(tmp_path, **{"checkpoint.load_step": 30}))
    assert "never committed" in str(e.value) and "step_30.tmp" in str(e.value)


def test_preflight_load_path_errors(tmp_path):
    with pytest.raises(ConfigError) as e:
        C.preflight(make_cfg(tmp_path / "run", **{"checkpoint.load_path": str(tmp_path / "missing")}))
    assert e.value.key == "checkpoint.load_path" and "does not exist" in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError) as e:
        C.preflight(make_cfg(tmp_path / "run", **{"checkpoint.load_path": str(tmp_path / "empty")}))
    assert "is not a checkpoint" in str(e.value)


def _saved_run(tmp_path, **old):
    old_cfg = make_cfg(tmp_path, **old)
    make_ckpt(tmp_path / "checkpoints", 20, manifest=info_of(old_cfg))
    return old_cfg


def test_preflight_refuses_model_shape_change(tmp_path):
    _saved_run(tmp_path, **{"model.preset": "tiny"})
    with pytest.raises(ConfigError) as e:
        C.preflight(make_cfg(tmp_path, **{"model.preset": "tiny", "model.dim": 128}))
    assert e.value.key == "model.dim"
    assert "128 here but 64 in" in str(e.value) and "step_20" in str(e.value)
    with pytest.raises(ConfigError) as e:
        C.preflight(make_cfg(tmp_path, **{"model.vocab_size": 512}))
    assert e.value.key == "model.vocab_size"
    with pytest.raises(ConfigError) as e:
        C.preflight(make_cfg(tmp_path, **{"model.name": "toy_cnn"}))
    assert e.value.key.startswith("model.")


def test_preflight_allows_safe_changes(tmp_path):
    _saved_run(tmp_path)
    cfg = make_cfg(tmp_path, **{"optim.lr": 1e-2, "train.steps": 500, "mesh.dp_shard": 4,
                                "launcher.nproc_per_node": 4, "checkpoint.interval": 7,
                                "logging.tensorboard": True})
    C.preflight(cfg)  # no error
    # The same preset spelled out as explicit dims is the same shape.
    C.preflight(make_cfg(tmp_path, **{"model.dim": 64, "model.n_layers": 2}))
    changes = C.config_changes(info_of(cfg), json.loads((tmp_path / "checkpoints" / "step_20" / C.MANIFEST).read_text()))
    assert any(c.startswith("optim.lr 0.0003 -> 0.01") for c in changes)
    assert any("world size 1 -> 4" in c for c in changes)


def test_preflight_engine_change_refused_unless_weights_only(tmp_path):
    _saved_run(tmp_path / "old", **{"engine.name": "megatron_fsdp"})
    with pytest.raises(ConfigError) as e:
        C.preflight(make_cfg(tmp_path / "old", **{"engine.name": "fsdp2"}))
    assert e.value.key == "engine" and "load_weights_only" in str(e.value)
    C.preflight(make_cfg(tmp_path / "new", **{"engine.name": "fsdp2", "checkpoint.load_path": str(tmp_path / "old"),
                                              "checkpoint.load_weights_only": True}))
    with pytest.raises(ConfigError) as e:  # weights only still needs the same model
        C.preflight(make_cfg(tmp_path / "new", **{"checkpoint.load_path": str(tmp_path / "old"),
                                                  "checkpoint.load_weights_only": True, "model.n_layers": 4}))
    assert e.value.key == "model.n_layers"


def test_preflight_freeze_change_refused_for_full_resume(tmp_path):
    _saved_run(tmp_path)
    with pytest.raises(ConfigError) as e:
        C.preflight(make_cfg(tmp_path, **{"model.freeze": ["tok_emb.*"]}))
    assert e.value.key == "model.freeze"


def test_preflight_never_needs_overwrite_and_fresh_is_fine(tmp_path):
    _saved_run(tmp_path)
    with pytest.raises(ConfigError) as e:
        C.preflight(make_cfg(tmp_path, **{"checkpoint.resume": "never", "model.dim": 128}))
    assert e.value.key == "checkpoint.resume" and "step_20" in str(e.value)
    C.preflight(make_cfg(tmp_path, **{"checkpoint.resume": "never", "checkpoint.overwrite": True, "model.dim": 128}))
    with pytest.raises(ConfigError) as e:  # a load_path that overwrite would move away with the rest
        C.preflight(make_cfg(tmp_path, **{"checkpoint.resume": "never", "checkpoint.overwrite": True,
                                          "checkpoint.load_path": str(tmp_path / "checkpoints" / "step_20")}))
    assert e.value.key == "checkpoint.load_path"
    C.preflight(make_cfg(tmp_path / "elsewhere"))


def test_preflight_data_change_refused_unless_allowed(tmp_path):
    from mfsdp_launch.checkpoint.manifest import SAMPLE_KEYS

    _saved_run(tmp_path)
    for key, value in (("train.seq_len", 64), ("train.seed", 7), ("data.name", "text")):
        assert key in SAMPLE_KEYS
        with pytest.raises(ConfigError) as e:
            C.preflight(make_cfg(tmp_path, **{key: value}))
        assert e.value.key == key and f"{value!r} here but" in e.value.problem, e.value
        assert "checkpoint.allow_data_change=true" in e.value.allowed and "resume=never" not in str(e.value)
        C.preflight(make_cfg(tmp_path, **{key: value, "checkpoint.allow_data_change": True}))
    # Not a data key for the synthetic data: allowed and printed, as before.
    C.preflight(make_cfg(tmp_path, **{"data.max_bytes": 1000}))


def test_preflight_does_not_import_torch(tmp_path):
    _saved_run(tmp_path)
    code = textwrap.dedent(f"""
        import sys
        from omegaconf import OmegaConf
        from mfsdp_launch import checkpoint
        from mfsdp_launch.planner.compose import typed_schema
        cfg = typed_schema({{"model": {{"name": "gpt"}}}})
        cfg.run.dir = {str(tmp_path)!r}
        OmegaConf.update(cfg, "optim.lr", 0.01, merge=False)
        checkpoint.preflight(cfg)  # resumes step_20: the compatibility path runs
        print("torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_fallback_seed_is_distinct_per_rank_step_and_seed():
    from mfsdp_launch.components.rng import fallback_seed

    assert fallback_seed(1234, 3, 100) != fallback_seed(1234, 3, 101)
    assert fallback_seed(1234, 3, 100) != fallback_seed(1235, 3, 100)
    assert len({fallback_seed(1234, r, 100) for r in range(8)}) == 8
    assert 0 <= fallback_seed(1, 2, 3) < 2**63


def test_preflight_with_raw_model_config_in_manifest(tmp_path):
    """A manifest whose model section is the raw model config (no resolved `shape`)."""
    old = make_cfg(tmp_path)
    manifest = {"model": OmegaConf.to_container(old.model), "engine": {"name": "fsdp2"},
                "mesh": {"world_size": 2}}
    make_ckpt(tmp_path / "checkpoints", 9, manifest=manifest)
    C.preflight(make_cfg(tmp_path, **{"model.dim": 64, "optim.lr": 0.1}))  # same resolved shape
    with pytest.raises(ConfigError) as e:
        C.preflight(make_cfg(tmp_path, **{"model.n_layers": 3}))
    assert e.value.key == "model.n_layers" and "3 here but 2 in" in str(e.value)


def test_config_changes_without_full_configs():
    old = {"mesh": {"dp_shard": 2, "world_size": 2}, "engine": {"name": "fsdp2", "zero_dp_strategy": 3},
           "world_size": 2, "versions": {"torch": "2.11.0"}}
    new = {"mesh": {"dp_shard": 1, "world_size": 1}, "engine": {"name": "fsdp2", "zero_dp_strategy": 2},
           "versions": {"torch": "2.13.0"}}
    assert C.config_changes(new, old) == [
        "mesh.dp_shard 2 -> 1", "engine.zero_dp_strategy 3 -> 2",
        "world size 2 -> 1 (DCP reshards model and optimizer)", "torch 2.11.0 -> 2.13.0"]


def test_scheduler_resume_keeps_a_device_lr_tensor_in_place():
    """Capturable FusedAdam (CUDA graphs) reads its LR from a tensor in the param group: resuming
    the schedule fills that tensor rather than replacing it with a float."""
    import torch

    from mfsdp_launch.core.schema import OptimConfig
    from mfsdp_launch.components.optim import build_scheduler, load_schedule

    def optimizer_with_tensor_lr():
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
        opt.param_groups[0]["lr"] = torch.tensor(1e-3)
        return opt

    ocfg = OptimConfig(lr=1e-3, warmup_steps=4)
    before = optimizer_with_tensor_lr()
    sched = build_scheduler(before, ocfg, 20)
    for _ in range(6):
        before.step()
        sched.step()
    after = optimizer_with_tensor_lr()
    lr_tensor = after.param_groups[0]["lr"]
    notes = load_schedule(build_scheduler(after, ocfg, 20), after, sched.state_dict())
    assert notes == []
    assert after.param_groups[0]["lr"] is lr_tensor
    assert float(lr_tensor) == pytest.approx(float(before.param_groups[0]["lr"]))
