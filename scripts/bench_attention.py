#!/usr/bin/env python3
"""Causal SDPA forward + backward per backend at one shape, on one GPU: milliseconds, TFLOP/s and
the largest output difference against FlashAttention-2, plus the backend torch picks by default
(`default`: the aten op the profiler records). One H100, torch 2.11 (session 37), the 1.4b shape at
mbs 8: cuDNN 1.119 ms, FlashAttention-2 2.09 ms, and torch's default was cuDNN's, so the gpt's
attention already runs the fastest of the three.

    python3 scripts/bench_attention.py                      # the 1.4b preset at mbs 8, seq 2048
    python3 scripts/bench_attention.py --batch 1 --seq 8192 --heads 32 --kv-heads 8
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def causal_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """Forward + backward of causal attention: QK^T and PV, 2 FLOPs a multiply-add, half the square,
    backward twice the forward."""
    forward = 2 * 2 * batch * heads * seq * seq * head_dim / 2
    return 3 * forward


def run(backend, q, k, v, grad, gqa: bool):
    for t in (q, k, v):
        t.grad = None
    with sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    out.backward(grad)
    return out


def time_backend(backend, q, k, v, grad, gqa: bool, iters: int) -> float:
    for _ in range(3):
        run(backend, q, k, v, grad, gqa)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run(backend, q, k, v, grad, gqa)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    kv = args.kv_heads or args.heads
    torch.manual_seed(0)

    def tensor(heads):
        return torch.randn(args.batch, heads, args.seq, args.head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True)

    q, k, v = tensor(args.heads), tensor(kv), tensor(kv)
    grad = torch.randn(args.batch, args.heads, args.seq, args.head_dim, device="cuda", dtype=torch.bfloat16)
    gqa = kv != args.heads
    flops = causal_flops(args.batch, args.heads, args.seq, args.head_dim)
    ref = run(BACKENDS["flash"], q, k, v, grad, gqa).detach().float()
    rows = []
    for name, backend in BACKENDS.items():
        try:
            out = run(backend, q, k, v, grad, gqa).detach().float()
            ms = time_backend(backend, q, k, v, grad, gqa, args.iters)
        except RuntimeError as exc:  # the backend cannot take this shape on this GPU
            rows.append({"backend": name, "error": str(exc).splitlines()[0][:160]})
            continue
        rows.append({"backend": name, "ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1),
                     "max_diff_vs_flash": float((out - ref).abs().max())})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    fused = sorted({e.name for e in prof.events() if e.name.startswith("aten::_scaled_dot_product_")})
    rows.append({"backend": "default", "runs": fused})
    flash_ms = next((r["ms"] for r in rows if r["backend"] == "flash" and "ms" in r), None)
    for r in rows:
        if flash_ms and "ms" in r:
            r["speed_vs_flash"] = round(flash_ms / r["ms"], 3)
        print(json.dumps({**vars(args), **r}))


if __name__ == "__main__":
    main()
