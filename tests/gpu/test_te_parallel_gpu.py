"""te_gpt's tensor, sequence and context parallelism under Megatron-FSDP, end to end through the
CLI (models/llama/te_parallel.py, engines/glu_layout.py): tiny dims, bf16, 20 steps.

* mesh.tp=2 (TE's tp_group + sequence parallelism) reproduces tp=1's loss curve;
* mesh.cp=2 (TE's p2p context-parallel attention, load-balanced batches) reproduces cp=1's;
* one run dir trained at tp=2, resumed at tp=1, then at tp=2 again, follows the tp=1 curve (DCP
  reshards every weight, TE's fused SwiGLU fc1 included);
* model.activation_checkpointing=full (TE's checkpoint) gives the losses of `none`, in fp32.

Each run is one short CLI launch (about 8 launches, under 3 minutes on 2 H200s).
"""

from __future__ import annotations

import pytest

from _harness import require_gpus, require_te
from test_e2e import cli, fresh_run_dir, rows

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

STEPS = 20
# decay_steps pins the LR schedule, so a resumed run follows the one uninterrupted run.
# The stdlib's sources as bytes (vocab 256): a curve that falls, unlike uniform synthetic tokens.
BASE = ("engine=megatron_fsdp", "model=te_gpt", "model.preset=tiny", "data=text", "data.max_bytes=2000000",
        "train.seq_len=64",
        "train.micro_batch_size=4", "precision.compute_dtype=bf16", "optim.lr=3e-3", "optim.warmup_steps=0",
        f"optim.decay_steps={STEPS}", "train.log_interval=1", "train.progress=false")
ONE = ("launcher.nproc_per_node=1",)
TP2 = ("launcher.nproc_per_node=2", "mesh.tp=2")
CP2 = ("launcher.nproc_per_node=2", "mesh.cp=2")
# bf16 runs whose reductions differ (tp all-gathers/reduce-scatters, cp's ring attention) drift
# apart by rounding; the acceptance bound.
REL = 2e-3


def train(name: str, *overrides: str, steps: int = STEPS, save: bool = False, run_dir=None):
    run_dir = run_dir or fresh_run_dir(name)
    proc = cli(name, *BASE, f"run.dir={run_dir}", f"train.steps={steps}",
               f"checkpoint.save_final={str(save).lower()}", *overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir


def losses(run_dir) -> dict:
    return {r["step"]: r["loss"] for r in rows(run_dir) if "loss" in r}


def assert_same_curve(ref: dict, got: dict, steps=range(1, STEPS + 1), rel=REL):
    assert sorted(s for s in got if s in steps) == list(steps), sorted(got)
    bad = {s: (ref[s], got[s]) for s in steps if abs(got[s] - ref[s]) > rel * abs(ref[s])}
    assert not bad, f"steps whose loss differs by more than {rel:.0e} (ref, got): {bad}"


@pytest.fixture(scope="module")
def reference():
    require_gpus(1)
    require_te()
    ref = losses(train("te_par_ref", *ONE))
    assert ref[STEPS] < ref[1] - 0.3, ref  # it learns: the comparisons below are not of flat curves
    return ref


@pytest.mark.multi_gpu
def test_tp2_matches_tp1(reference):
    require_gpus(2)
    assert_same_curve(reference, losses(train("te_par_tp2", *TP2)))


@pytest.mark.multi_gpu
def test_cp2_matches_cp1(reference):
    require_gpus(2)
    assert_same_curve(reference, losses(train("te_par_cp2", *CP2)))


@pytest.mark.multi_gpu
def test_checkpoint_reshards_tp2_to_tp1_and_back(reference):
    require_gpus(2)
    run_dir = train("te_par_reshard", *TP2, steps=7, save=True)
    for overrides, steps in ((ONE, 14), (TP2, STEPS)):
        proc_dir = train("te_par_reshard", *overrides, steps=steps, save=True, run_dir=run_dir)
        assert proc_dir == run_dir
    assert_same_curve(reference, losses(run_dir))


def test_full_activation_checkpointing_keeps_the_losses():
    """TE's checkpoint recomputes each layer in backward; in fp32 the losses equal `none`'s to
    1e-5 (recompute runs the same kernels on the same inputs; only reduction order could differ)."""
    require_gpus(1)
    require_te()
    fp32 = (*ONE, "precision.compute_dtype=fp32")
    off = losses(train("te_par_ac_off", *fp32, steps=5))
    full = losses(train("te_par_ac_full", *fp32, "model.activation_checkpointing=full", steps=5))
    assert_same_curve(off, full, steps=range(1, 6), rel=1e-5)
