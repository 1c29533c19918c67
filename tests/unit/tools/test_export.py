"""mfsdp-export on real checkpoints: the file's mode and durability, checksums verified, and every
failure (damaged, missing, unreadable) as one line with exit code 2."""

from __future__ import annotations

import json
import os
import stat

import pytest

from helpers import cli, cli_error
from mfsdp_launch import checkpoint as C
from mfsdp_launch.tools.export import main as export_main


@pytest.fixture
def run_dir(tmp_path):
    """A run dir with committed step_1 and step_2 of a small MLP (one process, real DCP)."""
    import torch
    import torch.nn as nn

    from mfsdp_launch.engines.fsdp2 import FSDP2Engine
    from mfsdp_launch.core.schema import CheckpointConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = FSDP2Engine(engine_cfg=None, sharding_cfg=None, precision_cfg=None, dims=None, mesh=None,
                         device=torch.device("cpu"))
    mgr = C.CheckpointManager(CheckpointConfig(interval=1), tmp_path / "run", manifest_info={"seed": 1},
                              rank=0, world_size=1, engine=engine)
    mgr.resume(model, opt, None, None)
    for step in (1, 2):
        model(torch.randn(2, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
        mgr.maybe_save(step, model, opt, None, None)
    return tmp_path / "run"


def flip(path, size=64):
    n = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(n // 2)
        data = f.read(size)
        f.seek(n // 2)
        f.write(bytes(b ^ 0xFF for b in data))


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("mfsdp-export: error: ")
    return err[0]


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_exported_file_gets_the_umask_mode(run_dir, tmp_path, fmt):
    if fmt == "safetensors":
        pytest.importorskip("safetensors")
    old = os.umask(0o022)
    try:
        out = tmp_path / f"model.{fmt}"
        assert export_main([str(run_dir), str(out), "--format", fmt]) == 0
        assert stat.S_IMODE(out.stat().st_mode) == 0o644  # safetensors alone writes 0600
        os.umask(0o027)
        assert export_main([str(run_dir), str(out), "--format", fmt]) == 0  # replaces it
        assert stat.S_IMODE(out.stat().st_mode) == 0o640
    finally:
        os.umask(old)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("model.")) == [f"model.{fmt}"]


def test_checksum_mismatch_refused_for_a_step_dir(run_dir, tmp_path, capsys):
    flip(run_dir / "checkpoints" / "step_2" / "__0_0.distcp")
    out = tmp_path / "m.safetensors"
    assert export_main([str(run_dir / "checkpoints" / "step_2"), str(out)]) == 2
    line = one_error_line(capsys)
    assert line == (f"mfsdp-export: error: CKPT_DIR: {run_dir / 'checkpoints' / 'step_2'} is damaged "
                    "(checksum mismatch in __0_0.distcp)")
    assert not out.exists() and not list(tmp_path.glob("m.safetensors*"))


def test_run_dir_export_falls_back_past_a_damaged_step(run_dir, tmp_path, capsys):
    flip(run_dir / "checkpoints" / "step_2" / ".metadata")
    out = tmp_path / "m.pt"
    assert export_main([str(run_dir), str(out), "--format", "torch"]) == 0
    captured = capsys.readouterr()
    assert captured.err.strip() == ("mfsdp-export: warning: step_2 is damaged (checksum mismatch in .metadata); "
                                    "trying the step before it")
    assert "of step 1 to" in captured.out


def test_missing_checkpoint_is_one_line(tmp_path, capsys):
    assert export_main([str(tmp_path / "nope"), str(tmp_path / "x.pt")]) == 2
    assert "does not exist" in one_error_line(capsys)


def test_damage_without_checksums_is_one_line_from_the_cli(run_dir, tmp_path):
    """An old manifest (no checksums): DCP itself meets the damage and raises CheckpointException, a
    BaseException. The CLI still prints one line, exit 2, no traceback."""
    step = run_dir / "checkpoints" / "step_2"
    manifest = json.loads((step / C.MANIFEST).read_text())
    for e in manifest["files"]:
        e.pop("checksum", None)  # (a manifest of today's main has none to begin with)
    (step / C.MANIFEST).write_text(json.dumps(manifest))
    shard = step / "__0_0.distcp"
    shard.write_bytes(b"\0" * shard.stat().st_size)  # same size, nothing DCP can read
    out = cli(str(step), str(tmp_path / "m.pt"), "--format", "torch", module="mfsdp_launch.tools.export", timeout=120)
    line = cli_error(out, tool="mfsdp-export")
    assert line.startswith(f"mfsdp-export: error: cannot read {step} (rank 0: "), out.stderr
    assert not (tmp_path / "m.pt").exists()
