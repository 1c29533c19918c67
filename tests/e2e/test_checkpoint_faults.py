"""Checkpoints that go wrong, with real processes, real DCP and real files: same-size damage caught
by checksums (resume falls back to the previous intact step, or refuses), a really full disk (a
small tmpfs), stale saves cleaned before a rerun, and old manifests without checksums."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import subprocess

import pytest

from helpers import SMOKE, cli, one_process_checkpoints, read_metrics, train_ranks
from mfsdp_launch import checkpoint as C
from mfsdp_launch.core.errors import ConfigError



# =============================================================================== helpers


def flip(path, offset=None, size=4096) -> None:
    """Invert `size` bytes in the middle of a file (same size, different content)."""
    n = path.stat().st_size
    offset = max(0, n // 2 - size // 2) if offset is None else offset
    with open(path, "r+b") as f:
        f.seek(offset)
        data = f.read(size)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in data))
    assert path.stat().st_size == n


def same_size_edit(path, old: str, new: str) -> None:
    assert len(old) == len(new)
    text = path.read_text()
    assert old in text, text
    path.write_text(text.replace(old, new, 1))


@contextlib.contextmanager
def small_disk(path, size: str):
    """A real filesystem of `size` at `path` (a tmpfs); skips where mounting is not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command: the disk-full test mounts a small tmpfs")
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root, as in CI): {out.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill_disk(path, leave: int = 0) -> None:
    """Write `path` until the disk is full, then give `leave` bytes back."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        chunk = b"\0" * (1 << 16)
        while True:
            try:
                os.write(fd, chunk)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
        if leave:
            os.ftruncate(fd, max(0, os.fstat(fd).st_size - leave))
    finally:
        os.close(fd)


def intact(step_dir) -> bool:
    manifest, problem = C.inspect_checkpoint(step_dir)
    return problem is None and C.verify_checksums(step_dir, manifest) is None


# =============================================================================== one process, real DCP


def _tiny(run_dir, **ck):
    return one_process_checkpoints(run_dir, sizes=(64, 256, 8), lr=1e-3, **ck)


def _train(model, opt, ts, mgr, steps):
    import torch

    for step in steps:
        model(torch.randn(4, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ts.step = step
        mgr.maybe_save(step, model, opt, None, ts)


def test_every_file_has_a_checksum_and_old_manifests_still_load(tmp_path, capsys):
    model, opt, ts, mgr = _tiny(tmp_path, interval=1)
    mgr.resume(model, opt, None, ts)
    _train(model, opt, ts, mgr, [1, 2])
    step2 = tmp_path / "checkpoints" / "step_2"
    manifest = json.loads((step2 / C.MANIFEST).read_text())
    on_disk = {p.name for p in step2.iterdir()} - {C.MANIFEST}
    assert {e["path"] for e in manifest["files"]} == on_disk
    for e in manifest["files"]:
        assert re.fullmatch(r"xxh3_64:[0-9a-f]{16}", e["checksum"]), e
        assert C.file_checksum(step2 / e["path"]) == (e["bytes"], e["checksum"])
    # A manifest written before checksums existed: the size check alone, and it resumes.
    for e in manifest["files"]:
        del e["checksum"]
    (step2 / C.MANIFEST).write_text(json.dumps(manifest))
    model, opt, ts, mgr = _tiny(tmp_path, interval=1)
    capsys.readouterr()
    assert mgr.resume(model, opt, None, ts) == 2 and ts.step == 2
    assert capsys.readouterr().out.startswith("resuming from step 2 (")


@pytest.mark.parametrize("victim", ["__0_0.distcp", ".metadata", "extra_rank0.pt"])
def test_same_size_damage_falls_back_in_process(tmp_path, capsys, victim):
    model, opt, ts, mgr = _tiny(tmp_path, interval=1)
    mgr.resume(model, opt, None, ts)
    _train(model, opt, ts, mgr, [1, 2])
    flip(tmp_path / "checkpoints" / "step_2" / victim, size=64)
    capsys.readouterr()
    model, opt, ts, mgr = _tiny(tmp_path, interval=1)
    assert mgr.resume(model, opt, None, ts) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"step_2 is damaged (checksum mismatch in {victim}), falling back to step_1", out
    assert out[1].startswith("resuming from step 1 (")


def test_no_intact_step_left_refuses_in_one_line(tmp_path):
    model, opt, ts, mgr = _tiny(tmp_path, interval=1)
    mgr.resume(model, opt, None, ts)
    _train(model, opt, ts, mgr, [1, 2])
    for step in (1, 2):
        flip(tmp_path / "checkpoints" / f"step_{step}" / "__0_0.distcp", size=64)
    model, opt, ts, mgr = _tiny(tmp_path, interval=1)
    with pytest.raises(ConfigError) as e:
        mgr.resume(model, opt, None, ts)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("checkpoint.resume: auto, but ")
    assert "step_2 is damaged (checksum mismatch in __0_0.distcp); step_1 is damaged (checksum mismatch" in msg


def test_a_real_full_disk_inside_dcp_fails_cleanly(tmp_path, monkeypatch):
    """DCP raises CheckpointException (a BaseException) on ENOSPC: .tmp removed, step_1 intact, one
    CheckpointError naming the cause; once there is space the next save works."""
    import torch.distributed.checkpoint as dcp

    raised = []
    real_save = dcp.save

    def watched_save(*args, **kwargs):  # the real save; records what it raised
        try:
            return real_save(*args, **kwargs)
        except BaseException as exc:
            raised.append(exc)
            raise

    monkeypatch.setattr(dcp, "save", watched_save)
    with small_disk(tmp_path / "disk", "2m") as disk:
        model, opt, ts, mgr = _tiny(disk / "run", interval=1, keep_last=5)
        mgr.resume(model, opt, None, ts)
        _train(model, opt, ts, mgr, [1])
        fill_disk(disk / "filler", leave=64 << 10)  # room for the small files, not for DCP's shard
        with pytest.raises(C.CheckpointError) as e:
            _train(model, opt, ts, mgr, [2])
        assert len(raised) == 1 and not isinstance(raised[0], Exception)  # DCP's own exception type
        msg = str(e.value)
        assert "\n" not in msg
        assert msg.startswith("checkpoint save of step 2 failed (the disk of ")
        assert "No space left on device" in msg and msg.endswith("intact: step_1")
        ck = disk / "run" / "checkpoints"
        assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_1"]
        assert intact(ck / "step_1")
        (disk / "filler").unlink()
        _train(model, opt, ts, mgr, [2])
        assert C.committed_steps(ck) == [1, 2] and intact(ck / "step_2")


def test_clean_stale_removes_only_uncommitted_saves(tmp_path):
    ck = tmp_path / "checkpoints"
    (ck / "step_3").mkdir(parents=True)
    (ck / "step_4.tmp").mkdir()
    (ck / "step_4.tmp" / "__0_0.distcp").write_bytes(b"x" * 100)
    (ck / "step_2.old.tmp").mkdir()
    (ck / "latest.tmp").write_text("step_4\n")
    removed = C.clean_stale(tmp_path)
    assert sorted(p.name for p in removed) == ["latest.tmp", "step_2.old.tmp", "step_4.tmp"]
    assert sorted(p.name for p in ck.iterdir()) == ["step_3"]
    assert C.clean_stale(tmp_path / "elsewhere") == []


# =============================================================================== through the CLI


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    """6 steps, a checkpoint every step, all kept (mfsdp-train's 2 ranks, helpers.train_ranks): step_1
    ... step_6. The resumes below go through the CLI."""
    run_dir = tmp_path_factory.mktemp("faults") / "base"
    train_ranks(*SMOKE, f"run.dir={run_dir}", "train.steps=6", "checkpoint.interval=1", "checkpoint.keep_last=6")
    assert C.committed_steps(run_dir / "checkpoints") == [1, 2, 3, 4, 5, 6]
    return run_dir


# Same-size damage, one kind per step: the resume walks back past each of them in one run.
DAMAGE = {
    6: ("__0_0.distcp", lambda p: flip(p)),  # 4 KiB inverted inside a shard
    5: (".metadata", lambda p: flip(p)),
    4: ("trainer.json", lambda p: same_size_edit(p, '"step": 4', '"step": 7')),  # valid JSON, wrong
}


@pytest.mark.slow
def test_cli_resume_falls_back_past_same_size_damage(base_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(base_run, run_dir)
    for step, (name, damage) in DAMAGE.items():
        damage(run_dir / "checkpoints" / f"step_{step}" / name)
    out = cli(*SMOKE, f"run.dir={run_dir}", "train.steps=6", "checkpoint.interval=1", "checkpoint.keep_last=6",
              timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    for step, (name, _) in DAMAGE.items():
        assert f"step_{step} is damaged (checksum mismatch in {name}), falling back to step_3" in lines, out.stdout
    assert f"resuming from step 3 ({run_dir / 'checkpoints' / 'step_3'})" in lines
    # The same mesh continues bit-identically from step 3, and the damaged steps are written again, intact.
    base = {r["step"]: r["loss"] for r in read_metrics(base_run)}
    assert {r["step"]: r["loss"] for r in read_metrics(run_dir)} == base
    assert all(intact(run_dir / "checkpoints" / f"step_{step}") for step in DAMAGE)


@pytest.mark.slow
def test_cli_refuses_when_no_intact_step_is_left(base_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(base_run, run_dir)
    for step in range(1, 7):
        flip(run_dir / "checkpoints" / f"step_{step}" / "__1_0.distcp")
    out = cli(*SMOKE, f"run.dir={run_dir}", "train.steps=8", timeout=300)
    assert out.returncode != 0
    line = [ln for ln in out.stderr.splitlines() if "no intact checkpoint" in ln]
    assert len(line) == 1, out.stderr
    assert "step_6 is damaged (checksum mismatch in __1_0.distcp); step_5 is damaged" in line[0]
    assert not (run_dir / "checkpoints" / "step_8").exists()


@pytest.mark.slow
def test_cli_disk_full_fails_cleanly_then_reruns_after_cleaning(tmp_path):
    with small_disk(tmp_path / "disk", "5m") as disk:
        run_dir = disk / "run"
        # step_2 and step_4 (1.9 MB each) fit in 5 MB; step_6 does not.
        out = cli(*SMOKE, f"run.dir={run_dir}", "train.steps=8", "checkpoint.interval=2", timeout=300)
        assert out.returncode != 0
        text = out.stdout + out.stderr
        cause = f"checkpoint save of step 6 failed (the disk of {run_dir / 'checkpoints'} is full: "
        assert cause in text, text[-4000:]
        assert re.search(r"failed \(the disk of \S+ is full: [\d.]+ MB free; ranks? [\d, ]+: ", text), text[-4000:]
        assert text.count(cause) <= 2  # once per rank at most (the worker prints what it raises)
        ck = run_dir / "checkpoints"
        assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_2", "step_4"]
        assert intact(ck / "step_2") and intact(ck / "step_4")

        # A save killed mid-write leaves its .tmp on the full disk: the launcher cleans it before it
        # writes config.yaml (today that write failed), and the run starts from step 4.
        (ck / "step_6.tmp").mkdir()
        fill_disk(ck / "step_6.tmp" / "__0_0.distcp")
        assert [p.name for p in C.clean_stale(run_dir)] == ["step_6.tmp"]
        out = cli(*SMOKE, f"run.dir={run_dir}", "train.steps=5", "checkpoint.save_final=false", timeout=300)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        assert f"resuming from step 4 ({ck / 'step_4'})" in out.stdout
        assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4, 5]
