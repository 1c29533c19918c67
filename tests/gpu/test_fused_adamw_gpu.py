"""One GPU, through the CLI: optim.impl=triton (components/fused_adamw.py) under Megatron-FSDP,
reading the bf16 main gradients where the engine reduced them (engine.use_decoupled_grad), with a
clip that bites every step and under a full-iteration CUDA graph. At one micro-batch a step on one
GPU bf16 main gradients hold what autograd produced, so each run must give the losses of torch's
fused AdamW over fp32 main gradients (clipped in its own kernel too) to float rounding."""

from __future__ import annotations

import pytest

import _one_gpu as G
from _one_gpu import assert_close, assert_learns, uses

pytestmark = pytest.mark.gpu

SEQ = 64
STEPS = 8
BASE = [*G.tiny_gpt_bf16(SEQ, STEPS), "train.grad_clip=0.05", "checkpoint.save_final=false"]
TORCH = ["optim.impl=fused", "precision.main_grads_dtype=fp32"]
OURS = ["optim.impl=triton", "precision.main_grads_dtype=bf16", "engine.use_decoupled_grad=true"]

G.train("fa_torch", *BASE, *TORCH)
G.train("fa_triton", *BASE, *OURS)
G.train("fa_torch_graph", *BASE, *TORCH, "train.cuda_graph=full_iteration")
G.train("fa_triton_graph", *BASE, *OURS, "train.cuda_graph=full_iteration")


@pytest.mark.parametrize("ours,ref", [("fa_triton", "fa_torch"), ("fa_triton_graph", "fa_torch_graph")])
@uses(lambda p: [p["ours"], p["ref"]])
def test_the_triton_adamw_gives_torch_fused_adamws_losses(request, ours, ref):
    want = G.get(request, ref).ok().losses()
    assert_learns(want, STEPS, min_drop=0.3, what=ref)
    r = G.get(request, ours).ok()
    assert str(r.config().optim.impl) == "triton"
    assert_close(r.losses(), want, range(1, STEPS + 1), rel=1e-3, what=f"{ours} vs {ref}")  # (prints the worst)
