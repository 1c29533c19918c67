"""model.attention_kernel=cudnn on one GPU: the gpt's attention runs cuDNN's fused SDPA (the aten
op the profiler records), gives FlashAttention-2's outputs and gradients to bf16 rounding, and
trains through the CLI, eager and compiled, to the losses of the default kernel."""

from __future__ import annotations

import pytest

import _one_gpu as G
from _harness import gpu_count
from _one_gpu import assert_close, assert_learns, uses

pytestmark = pytest.mark.gpu

SEQ = 64
STEPS = 8
BASE = [*G.tiny_gpt_bf16(SEQ, STEPS), "checkpoint.save_final=false"]

G.train("attn_auto", *BASE)
G.train("attn_cudnn", *BASE, "model.attention_kernel=cudnn")
G.train("attn_auto_compile", *BASE, "train.compile=true")
G.train("attn_cudnn_compile", *BASE, "model.attention_kernel=cudnn", "train.compile=true")


def _attention_ops_and_grads(kernel: str):
    import torch

    from mfsdp_launch.models.llama.dims import GPTDims
    from mfsdp_launch.models.llama.gpt_modules import GPT, use_attention_kernel

    torch.manual_seed(0)
    # The 1.4b preset's head size (128) at 4 heads, 2 layers, a 1k sequence.
    dims = GPTDims(dim=512, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=1024, vocab_size=512,
                   tie_embeddings=False, norm_eps=1e-5, rope_theta=10000.0)
    model = use_attention_kernel(GPT(dims, dtype=torch.bfloat16).cuda(), kernel)
    model.init_weights()
    tokens = torch.randint(0, 512, (2, 1024), device="cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        logits = model(tokens)
        logits.float().square().mean().backward()
    ops = {e.name for e in prof.events() if "attention" in e.name}
    return ops, logits.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


def test_cudnn_attention_runs_cudnn_and_matches_the_default():
    if gpu_count() < 1:
        pytest.skip("needs a CUDA GPU")
    auto_ops, auto_out, auto_grads = _attention_ops_and_grads("auto")
    ops, out, grads = _attention_ops_and_grads("cudnn")
    print(f"auto: {sorted(auto_ops)}\ncudnn: {sorted(ops)}")
    assert "aten::_scaled_dot_product_cudnn_attention" in ops, ops
    assert "aten::_scaled_dot_product_cudnn_attention" not in auto_ops, auto_ops
    worst = (out - auto_out).abs().max().item() / auto_out.abs().max().item()
    grad_worst = max((grads[n] - g).norm().item() / g.norm().item() for n, g in auto_grads.items())
    print(f"outputs {worst:.2e}, gradients {grad_worst:.2e} (relative to the default kernel's)")
    assert worst < 2e-2 and grad_worst < 2e-2, (worst, grad_worst)


@pytest.mark.parametrize("ours,ref", [("attn_cudnn", "attn_auto"), ("attn_cudnn_compile", "attn_auto_compile")])
@uses(lambda p: [p["ours"], p["ref"]])
def test_cudnn_attention_trains_to_the_default_kernels_losses(request, ours, ref):
    want = G.get(request, ref).ok().losses()
    assert_learns(want, STEPS, min_drop=0.3, what=ref)
    r = G.get(request, ours).ok()
    assert str(r.config().model.attention_kernel) == "cudnn"
    got = r.losses()
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in range(1, STEPS + 1))
    print(f"{ours} vs {ref}: max relative loss difference {worst:.2e} over steps 1..{STEPS}")
    assert_close(got, want, range(1, STEPS + 1), rel=1e-2, what=f"{ours} vs {ref}")
