"""Tensor parallelism for `gpt` under FSDP2 on gloo (models/parallelize.py): the tp=2 loss curve
equals tp=1's, and DCP checkpoints reshard between tp=2 and tp=1 in both directions."""

import json

import pytest

from conftest import cli

# decay_steps pins the LR schedule, so a 10-step run followed by a resume to 20 equals one 20-step run.
BASE = ["engine=fsdp2", "model=gpt", "model.preset=tiny", "data=synthetic", "train.seq_len=32",
        "train.log_interval=1", "train.progress=false", "optim.warmup_steps=0", "optim.lr=3e-3",
        "optim.decay_steps=20", "train.micro_batch_size=4"]
ONE = ["launcher.nproc_per_node=1"]
TP2 = ["launcher.nproc_per_node=2", "mesh.tp=2"]


def run(run_dir, *overrides, steps=20, save=False):
    out = cli(*BASE, f"run.dir={run_dir}", f"train.steps={steps}", f"checkpoint.save_final={str(save).lower()}",
              *overrides, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out


def metrics(run_dir):
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def assert_same_curve(a, b, steps):
    for step in steps:
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=2e-4), step
        assert b[step]["grad_norm"] == pytest.approx(a[step]["grad_norm"], rel=2e-3), step


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp") / "one"
    run(path, *ONE)
    return metrics(path)


@pytest.mark.slow
def test_tp2_with_dp2_on_4_ranks_matches_tp1(tmp_path, reference):
    run(tmp_path / "tp2", "launcher.nproc_per_node=4", "mesh.tp=2", "train.micro_batch_size=2")
    tp2 = metrics(tmp_path / "tp2")
    assert sorted(tp2) == list(range(1, 21))
    assert len({r["loss"] for r in tp2.values()}) > 10  # the weights move
    assert tp2[1]["grad_norm"] == pytest.approx(reference[1]["grad_norm"], rel=1e-5)
    assert_same_curve(reference, tp2, range(1, 21))


@pytest.mark.slow
def test_checkpoint_reshards_tp2_to_tp1_and_back(tmp_path, reference):
    """One run dir: steps 1-7 at tp=2, 8-14 resumed at tp=1, 15-20 resumed at tp=2 again."""
    run(tmp_path / "run", *TP2, steps=7, save=True)
    for overrides, steps in ((ONE, 14), (TP2, 20)):
        out = run(tmp_path / "run", *overrides, steps=steps, save=True)
        assert "resum" in (out.stdout + out.stderr).lower()
    assert_same_curve(reference, metrics(tmp_path / "run"), range(1, 21))
