"""One GPU: the eager step's RoPE kernel (models/llama/rope_kernel.py) against the plain torch
math it replaces, in bf16: forward and backward within one unit in the last place, almost all
elements bitwise; and an eager gpt's loss and gradients with the kernel equal those without it
(the kernel did run: its launches are counted)."""

from __future__ import annotations

import pytest

from _harness import require_gpus

pytestmark = pytest.mark.gpu


def test_the_kernel_equals_the_plain_math_in_bf16():
    require_gpus(1)
    import torch

    from mfsdp_launch.models.llama import rope_kernel
    from mfsdp_launch.models.llama.gpt_modules import plain_rope, rope_cos_sin

    torch.manual_seed(0)
    B, T, H, hd = 4, 2048, 16, 128
    cos, sin = rope_cos_sin(T, hd, 10000.0, "cuda")
    base = torch.randn(B, T, H, hd, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(B, H, T, hd, device="cuda", dtype=torch.bfloat16)
    x = base.transpose(1, 2).requires_grad_(True)
    y = rope_kernel.fused_rope(x, cos, sin)
    y.backward(g)
    xr = base.transpose(1, 2).requires_grad_(True)
    yr = plain_rope(xr, cos, sin)
    yr.backward(g)
    for name, a, b in (("forward", y, yr), ("backward", x.grad, xr.grad)):
        rel = ((a.float() - b.float()).abs() / b.float().abs().clamp(min=1e-2)).max().item()
        differ = (a != b).float().mean().item()
        print(f"rope {name}: max rel diff {rel:.2e}, elements that differ {100 * differ:.3f} %")
        assert rel <= 2 ** -7 and differ < 0.01
    assert y.stride() == x.stride()


def test_an_eager_gpt_trains_alike_with_the_kernel(monkeypatch):
    require_gpus(1)
    import torch

    from mfsdp_launch.models.llama import rope_kernel
    from mfsdp_launch.models.llama.dims import GPTDims
    from mfsdp_launch.models.llama.gpt_modules import GPT

    dims = GPTDims(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=688, vocab_size=1000,
                   tie_embeddings=False, norm_eps=1e-5, rope_theta=1e4)
    ids = torch.randint(0, 1000, (2, 256), device="cuda")

    def loss_and_grads():
        torch.manual_seed(0)
        model = GPT(dims, dtype=torch.bfloat16).cuda()
        loss = torch.nn.functional.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())
        loss.backward()
        return loss.item(), torch.cat([p.grad.float().flatten() for p in model.parameters()])

    launches = []
    rotate = rope_kernel.rotate
    monkeypatch.setattr(rope_kernel, "rotate", lambda *a: launches.append(1) or rotate(*a))
    fused_loss, fused_grads = loss_and_grads()
    assert len(launches) == 2 * 2 * dims.n_layers  # q and k of each layer, forward and backward
    monkeypatch.setattr(rope_kernel, "applies", lambda *a: False)
    plain_loss, plain_grads = loss_and_grads()
    rel = ((fused_grads - plain_grads).norm() / plain_grads.norm()).item()
    print(f"eager gpt: loss {fused_loss:.6f} with the kernel, {plain_loss:.6f} without; grads rel {rel:.2e}")
    assert abs(fused_loss - plain_loss) < 1e-3 and rel < 1e-2
