"""models/llama/rope_kernel.py in Triton's interpreter on CPU tensors: forward and backward equal
gpt_modules.apply_rope's plain math (which runs on the CPU) on [B, H, T, hd] views of [B, T, H, hd]
tensors, the layout the attention hands it; the output keeps that layout; calls the kernel cannot
take (fp32, a broadcast table) stay on the plain path."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent("""
    import json, torch
    from mfsdp_launch.models.llama import rope_kernel
    from mfsdp_launch.models.llama.gpt_modules import apply_rope, rope_cos_sin
    torch.manual_seed(0)
    B, T, H, hd = 2, 5, 3, 12   # a head dim whose half (6) is not a power of two
    cos, sin = rope_cos_sin(T, hd, 10000.0, "cpu")
    base = torch.randn(B, T, H, hd) * 3
    out = {}
    for dt in (torch.float16, torch.bfloat16):
        g = torch.randn(B, H, T, hd).to(dt)
        x = base.to(dt).transpose(1, 2).requires_grad_(True)
        y = rope_kernel.fused_rope(x, cos, sin)
        y.backward(g)
        xr = base.to(dt).transpose(1, 2).requires_grad_(True)
        yr = apply_rope(xr, cos, sin)
        yr.backward(g)
        ulp = lambda a, b: ((a.float() - b.float()).abs() / b.float().abs().clamp(min=1e-2)).max().item()
        out[str(dt)] = dict(fwd=ulp(y, yr), bwd=ulp(x.grad, xr.grad), layout=list(y.stride()) == list(x.stride()))
    out["applies"] = [rope_kernel.applies(base.bfloat16().transpose(1, 2), cos, sin),
                      rope_kernel.applies(base.transpose(1, 2), cos, sin),             # fp32 x
                      rope_kernel.applies(base.bfloat16().transpose(1, 2), cos[:1], sin[:1])]  # a broadcast row
    print(json.dumps(out))
""")


def test_the_kernel_rotates_as_apply_rope_forward_and_backward():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # fp16: bitwise. bf16: within one unit in the last place (the interpreter rounds bf16 by
    # truncation where CUDA rounds to nearest; tests/gpu/test_rope_gpu.py holds the GPU to it).
    assert out["torch.float16"] == {"fwd": 0.0, "bwd": 0.0, "layout": True}
    assert out["torch.bfloat16"]["fwd"] <= 2 ** -7 and out["torch.bfloat16"]["bwd"] <= 2 ** -7
    assert out["torch.bfloat16"]["layout"]
    assert out["applies"] == [True, False, False]
