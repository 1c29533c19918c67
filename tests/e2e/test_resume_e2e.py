"""Checkpoints through the CLI: exact resume, resharding to another world size, stray and missing
checkpoints, and a graceful stop on SIGTERM to the launcher (real processes, gloo, DCP)."""

import shutil
import signal
import subprocess
import time

import pytest
import torch

from helpers import SMOKE, read_metrics, smoke_run, start_cli, train_ranks

pytestmark = pytest.mark.slow

run = smoke_run


def exported(run_dir, tmp_path, name):
    from mfsdp_launch.tools.export import export

    target = tmp_path / f"{name}.pt"
    export(run_dir, target, fmt="torch")
    return torch.load(target)


def test_resume_is_exact_and_reshards(tmp_path):
    """B (fresh, then resumed) equals A's one run; A's step 3 resumes at 1 rank (C). A, C and B's
    fresh start run as mfsdp-train's ranks (helpers.train_ranks): the CLI is B's resume."""
    a, b, c = tmp_path / "A", tmp_path / "B", tmp_path / "C"
    train_ranks(*SMOKE, f"run.dir={a}", "train.steps=6", "checkpoint.interval=3")
    # A save killed mid-write left a .tmp: the fresh run ignores it (it is no checkpoint) and cleans it.
    (b / "checkpoints" / "step_999.tmp").mkdir(parents=True)
    first = train_ranks(*SMOKE, f"run.dir={b}", "train.steps=3")
    assert "starting fresh" in first
    assert not (b / "checkpoints" / "step_999.tmp").exists()
    assert (b / "checkpoints" / "step_3" / "manifest.json").is_file()
    second = run(b, "train.steps=6")
    assert "resuming from step 3" in second.stdout

    losses_a = {r["step"]: r["loss"] for r in read_metrics(a)}
    losses_b = {r["step"]: r["loss"] for r in read_metrics(b)}
    assert sorted(losses_b) == list(range(1, 7))  # one row per step, none duplicated
    assert losses_a == losses_b  # bit-identical on the same mesh
    wa, wb = exported(a, tmp_path, "a"), exported(b, tmp_path, "b")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)

    # A's step-3 checkpoint continues at another world size (2 ranks -> 1): DCP reshards.
    (c / "checkpoints").mkdir(parents=True)
    shutil.copytree(a / "checkpoints" / "step_3", c / "checkpoints" / "step_3")
    # Same global batch (16 x 2 microbatches x 1 rank = 8 x 2 x 2 ranks): the same samples.
    out = train_ranks(*SMOKE, f"run.dir={c}", "train.steps=5", "launcher.nproc_per_node=1", "mesh.dp_outer=1",
                      "mesh.dp_shard=1", "train.micro_batch_size=16")
    assert "resuming from step 3" in out
    assert [r["step"] for r in read_metrics(c)] == [4, 5]
    assert read_metrics(c)[0]["loss"] == pytest.approx(losses_a[4], rel=1e-4)


def test_resume_must_without_a_checkpoint_fails_clearly(tmp_path):
    """(A stray .tmp is ignored by a fresh run: test_resume_is_exact_and_reshards.)"""
    empty = tmp_path / "empty"
    out = run(empty, "train.steps=2", "checkpoint.resume=must", expect=2)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "checkpoint.resume" in lines[0] and "no committed checkpoint" in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_sigterm_to_the_launcher_saves_exits_interrupted_then_resumes(tmp_path):
    from mfsdp_launch.core import exit_codes

    run_dir = tmp_path / "pre"
    proc = start_cli(*SMOKE, f"run.dir={run_dir}", "train.steps=100000", stdout=subprocess.PIPE,
                     stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and len(read_metrics(run_dir)) < 3:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == exit_codes.INTERRUPTED, (out + err)[-3000:]  # not 0: `&& next` must not run
    assert "stopping at step" in out + err
    stopped = read_metrics(run_dir)[-1]["step"]
    assert (run_dir / "checkpoints" / f"step_{stopped}" / "manifest.json").is_file()
    last = err.strip().splitlines()[-1]  # the summary names the step, the signal, the checkpoint, the code
    assert last.startswith(f"mfsdp-train: interrupted at step {stopped}/100000") and "(SIGTERM)" in last, err
    assert f"last checkpoint step_{stopped}" in last and "exit code 3" in last
    # The resume, as mfsdp-train's ranks run it (helpers.train_ranks): the CLI's part was the stop.
    again = train_ranks(*SMOKE, f"run.dir={run_dir}", f"train.steps={stopped + 2}")
    assert f"resuming from step {stopped}" in again
