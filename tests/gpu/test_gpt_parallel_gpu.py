"""`gpt` tensor parallelism and activation checkpointing on GPUs, through the CLI (marker gpu):
  * mesh.tp=2 on 2 GPUs (NCCL, bf16 compute) reproduces the 1-GPU tp=1 loss curve over 20 steps
    (relative difference < 2e-3, the issue's bound for bf16). Next to it, the same global batch as
    data parallelism over 2 GPUs (tp=1, 2 x mbs 2): how far bf16 rounding alone moves the curve
    when only the order of the sums changes, i.e. the floor any tp=2 run sits on;
  * model.activation_checkpointing=full|selective gives the losses of none (fp32, 1e-5) under
    both engines, with a lower peak."""

from __future__ import annotations

import pytest

from _harness import require_gpus
from test_e2e import cli, fresh_run_dir, rows

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu, pytest.mark.slow]

BASE = ["model=gpt", "model.preset=125m", "model.n_kv_heads=4", "data=text", "data.max_bytes=4000000", "train.seq_len=1024",
        "train.micro_batch_size=4", "train.log_interval=1", "train.progress=false", "optim.warmup_steps=0",
        "optim.lr=6e-4", "optim.decay_steps=20", "checkpoint.save_final=false", "engine.backend=nccl"]
# lr 6e-4: GPT-3's for its 125M model. (At lr 1e-3 without warm-up, session 6 measured tp=2 vs
# tp=1 at 2.4e-3 on one step of 20, median 5.5e-4: the loss falls 10.7 -> 3.0 in 20 steps, and so
# steep a curve amplifies each rounding difference.)
BF16 = ["precision.compute_dtype=bf16", "precision.main_params_dtype=fp32", "precision.main_grads_dtype=fp32"]


def _train(name: str, *overrides: str, steps: int = 20):
    run_dir = fresh_run_dir(name)
    proc = cli(name, *BASE, f"train.steps={steps}", f"run.dir={run_dir}", *overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r["step"]: r for r in rows(run_dir)}


def test_tp2_reproduces_tp1_in_bf16():
    require_gpus(2)
    one = _train("gpt_tp1", "engine=fsdp2", "launcher.nproc_per_node=1", *BF16)
    two = _train("gpt_tp2", "engine=fsdp2", "launcher.nproc_per_node=2", "mesh.tp=2", *BF16)
    dp2 = _train("gpt_dp2", "engine=fsdp2", "launcher.nproc_per_node=2", "train.micro_batch_size=2", *BF16)

    def diffs(other):
        return sorted(abs(other[s]["loss"] - one[s]["loss"]) / one[s]["loss"] for s in range(1, 21))

    tp, floor = diffs(two), diffs(dp2)
    print(f"20 steps bf16, losses {one[1]['loss']:.4f} -> {one[20]['loss']:.4f}; relative loss difference "
          f"to tp=1 on 1 GPU: tp=2 max {tp[-1]:.2e} median {tp[10]:.2e}; dp=2 (the rounding floor) "
          f"max {floor[-1]:.2e} median {floor[10]:.2e}")
    assert one[20]["loss"] < one[1]["loss"] - 0.5  # it trains
    assert tp[-1] < 2e-3


@pytest.mark.parametrize("engine", ["fsdp2", "megatron_fsdp"])
def test_activation_checkpointing_keeps_the_losses_and_lowers_the_peak(engine):
    require_gpus(2)
    common = (f"engine={engine}", "launcher.nproc_per_node=2", "precision.compute_dtype=fp32")
    runs = {mode: _train(f"gpt_ac_{mode}_{engine}", *common, f"model.activation_checkpointing={mode}", steps=5)
            for mode in ("none", "full", "selective")}
    for mode in ("full", "selective"):
        for s in range(1, 6):
            assert runs[mode][s]["loss"] == pytest.approx(runs["none"][s]["loss"], rel=1e-5), (mode, s)
    peaks = {mode: max(r["peak_mem_gib"] for r in rows_.values()) for mode, rows_ in runs.items()}
    print(f"{engine}: peak GiB by activation_checkpointing: {peaks}")
    assert peaks["full"] < peaks["selective"] < peaks["none"]
