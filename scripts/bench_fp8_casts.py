"""The rowwise FP8 casts (mfsdp_launch/components/fp8_casts.py) on one GPU, for the kinds of tensor
one micro-batch of the 8B slice casts (model.preset=8b's dims, seq 8192; q/k/v and gate/up apart,
as in the HF Llama): each shape's casts checked bit for bit
against plain torch, then the amax pass and the cast pass timed apart, in GB/s of the bytes each
must move (amax reads 2 bytes an element; the cast reads 2 and writes 2).

    python3 scripts/bench_fp8_casts.py            # a table; --json for one object
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from mfsdp_launch.components import fp8_casts
from mfsdp_launch.models.llama.dims import GPT_PRESETS

SEQ = 8192  # the slice's tokens a micro-batch


def slice_shapes(preset: str = "8b", tokens: int = SEQ) -> dict:
    """name -> [M, N]: inputs x, weights w and output gradients dy of the preset's layers and head."""
    p = GPT_PRESETS[preset]
    dim, ffn, vocab = p["dim"], p["ffn_dim"], p["vocab_size"]
    kv = p["n_kv_heads"] * dim // p["n_heads"]
    return {"x [T, dim]": (tokens, dim), "x [T, ffn]": (tokens, ffn), "w_up [ffn, dim]": (ffn, dim),
            "w_down [dim, ffn]": (dim, ffn), "w_kv [kv, dim]": (kv, dim), "dy [T, ffn]": (tokens, ffn),
            "dy [T, kv]": (tokens, kv), "w_head [vocab, dim]": (vocab, dim), "dy_head [T, vocab]": (tokens, vocab)}


def _same(got, want) -> bool:
    views = [(g.view(torch.uint8), w.view(torch.uint8)) if g.dtype == torch.float8_e4m3fn else (g, w)
             for g, w in zip(got, want)]
    return all(torch.equal(g, w) for g, w in views)


def measure(m: int, n: int) -> dict:
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16) * torch.logspace(-3, 3, n, device="cuda")
    exact = _same(fp8_casts.launch_casts(x), fp8_casts.reference_casts(x))  # (also tunes both kernels)
    row = torch.zeros(m, device="cuda")
    col = torch.zeros(n, device="cuda")
    q = torch.empty(m, n, device="cuda", dtype=torch.float8_e4m3fn)
    qt = torch.empty(n, m, device="cuda", dtype=torch.float8_e4m3fn)
    rinv, cinv = torch.empty(m, device="cuda"), torch.empty(n, device="cuda")
    amax_ms = triton.testing.do_bench(lambda: fp8_casts._amax_kernel[
        lambda c: (triton.cdiv(m, c["BM"] * c["GROUP"]), triton.cdiv(n, c["BN"]))](x, row, col, m, n, x.stride(0)))
    cast_ms = triton.testing.do_bench(lambda: fp8_casts._cast_kernel[
        lambda c: (triton.cdiv(m, c["BM"]), triton.cdiv(n, c["BN"]))](
        x, row, col, q, qt, rinv, cinv, m, n, x.stride(0), ROUND=False))
    copy_ms = triton.testing.do_bench(lambda: q.copy_(x))  # a bf16 read + an 8-bit write: the bar
    elems = m * n
    return {"shape": [m, n], "exact": exact, "amax_ms": amax_ms, "cast_ms": cast_ms,
            "amax_GBps": 2 * elems / amax_ms / 1e6, "cast_GBps": 4 * elems / cast_ms / 1e6,
            "copy_GBps": 3 * elems / copy_ms / 1e6,
            "amax_config": str(fp8_casts._amax_kernel.best_config), "cast_config": str(fp8_casts._cast_kernel.best_config)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = {name: measure(*shape) for name, shape in slice_shapes().items()}
    if a.json:
        print(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    else:
        print(f"{torch.cuda.get_device_name()}\n{'tensor':22} {'exact':>5} {'amax ms':>8} {'GB/s':>6} "
              f"{'cast ms':>8} {'GB/s':>6} {'copy GB/s':>9}")
        for name, r in rows.items():
            print(f"{name:22} {str(r['exact']):>5} {r['amax_ms']:8.3f} {r['amax_GBps']:6.0f} {r['cast_ms']:8.3f} "
                  f"{r['cast_GBps']:6.0f} {r['copy_GBps']:9.0f}")
    return 0 if all(r["exact"] for r in rows.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
