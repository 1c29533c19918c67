"""Gradient clipping inside torch's fused AdamW (rank/loop.py arms the optimizer with the clip's
divisor instead of scaling every gradient first), as mfsdp-train's ranks run it under FSDP2 on gloo:
optim.impl=fused ends on the weights of optim.impl=foreach, which scales the gradients itself, to
float rounding, with a clip that bites every step; without the clip the weights end elsewhere."""

from __future__ import annotations

import pytest

from helpers import train_ranks

torch = pytest.importorskip("torch")

RUN = ["+recipe=cpu_smoke", "train.progress=false", "train.steps=6", "train.log_interval=6", "train.seq_len=32",
       "train.micro_batch_size=2", "train.grad_accum_steps=1", "data.max_bytes=200000", "optim.warmup_steps=0"]


@pytest.mark.slow
def test_the_clip_in_the_fused_step_lands_where_scaled_gradients_do(tmp_path):
    from mfsdp_launch.checkpoint.weights import read_model_state

    finals = {}
    for name, extra in (("in_step", ["optim.impl=fused", "train.grad_clip=0.05"]),
                        ("scaled", ["optim.impl=foreach", "train.grad_clip=0.05"]),
                        ("unclipped", ["optim.impl=fused", "train.grad_clip=null"])):
        run = tmp_path / name
        train_ranks(*RUN, f"run.dir={run}", *extra)
        finals[name] = read_model_state(run / "checkpoints" / "step_6")[0]

    def worst(a, b):
        return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp_min(1e-12)).item() for k in b)

    print(f"in step vs scaled: {worst(finals['in_step'], finals['scaled']):.2e}; "
          f"vs unclipped: {worst(finals['in_step'], finals['unclipped']):.2e}")
    assert finals["in_step"].keys() == finals["scaled"].keys()
    assert worst(finals["in_step"], finals["scaled"]) < 1e-5
    assert worst(finals["in_step"], finals["unclipped"]) > 1e-3
