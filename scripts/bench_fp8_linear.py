"""One linear's forward + backward at the 8B slice's shapes (8192 tokens): bf16, torchao's rowwise
Float8Linear compiled (its casts fused by Inductor), and fp8.recipe=fused_rowwise's linear
(components/fp8_linear.py); and the fused casts alone, in GB/s of the 6 bytes an element they move.
Where a whole step's time goes is scripts/bench.py's (`--group fused_rowwise`); this says which
shape gains what.

    python3 scripts/bench_fp8_linear.py [--tokens 8192] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn as nn

# (name, in_features, out_features): gpt's fused qkv, wo, fused gate/up, down, and the 128k head.
SHAPES = [("wqkv", 4096, 6144), ("wo", 4096, 4096), ("w_gate_up", 4096, 28672), ("w_down", 14336, 4096),
          ("lm_head", 4096, 128256)]


def _time(fn, iters: int = 20, warmup: int = 5) -> float:
    """Median milliseconds of fn() over `iters` CUDA-event-timed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _fwd_bwd(layer, x, dy):
    def step():
        layer(x).backward(dy)
    return step


def _gemms(xc, wc, dc):
    """The linear's three FP8 GEMMs alone, on casts made once (fp8_linear.py's operands)."""
    xq, x_inv, xqt, xt_inv = xc
    wq, w_inv, wqt, wt_inv = wc
    dq, d_inv, dqt, dt_inv = dc

    def mm(a, b, sa, sb):
        return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)

    def step():
        mm(xq, wq.t(), x_inv[:, None], w_inv[None, :])
        mm(dq, wqt.t(), d_inv[:, None], wt_inv[None, :])
        mm(dqt, xqt.t(), dt_inv[:, None], xt_inv[None, :])
    return step


def _layers(k: int, n: int):
    from mfsdp_launch.components import fp8_linear

    made = {}
    base = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    made["bf16"] = base
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        ao = nn.Sequential(nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16))
        ao[0].weight.data.copy_(base.weight.data)
        convert_to_float8_training(ao, config=Float8LinearConfig.from_recipe_name("rowwise"))
        made["torchao_rowwise_compiled"] = torch.compile(ao)
    except ImportError:
        pass
    ours = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    ours.weight.data.copy_(base.weight.data)
    fp8_linear.convert([ours])
    made["fused_rowwise"] = ours
    return made


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--json", help="write the rows here too")
    args = p.parse_args()
    from mfsdp_launch.components.fp8_casts import launch_casts

    rows = []
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.tokens} tokens")
    print(f"{'shape':<10} {'K x N':>14} {'bf16 ms':>9} {'torchao ms':>11} {'fused ms':>9} {'fused/bf16':>10} "
          f"{'fused/ao':>9} {'FP8 GEMMs ms':>12} {'casts ms x/W/dy':>17} {'GB/s x/W/dy':>16}")
    for name, k, n in SHAPES:
        x = torch.randn(args.tokens, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(args.tokens, n, device="cuda", dtype=torch.bfloat16)
        ms = {kind: _time(_fwd_bwd(layer, x, dy)) for kind, layer in _layers(k, n).items()}
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        tensors = {"x": x.detach(), "W": w, "dy": dy}
        casts = {what: _time(lambda t=t: launch_casts(t)) for what, t in tensors.items()}
        gbs = {what: 6 * tensors[what].numel() / (t * 1e6) for what, t in casts.items()}
        gemms = _time(_gemms(*(launch_casts(t) for t in tensors.values())))
        ao = ms.get("torchao_rowwise_compiled", float("nan"))
        row = dict(shape=name, k=k, n=n, tokens=args.tokens, ms=ms, casts_ms=casts, casts_gb_s=gbs, fp8_gemms_ms=gemms)
        rows.append(row)
        print(f"{name:<10} {f'{k} x {n}':>14} {ms['bf16']:9.3f} {ao:11.3f} {ms['fused_rowwise']:9.3f} "
              f"{ms['bf16'] / ms['fused_rowwise']:9.3f}x {ao / ms['fused_rowwise']:8.3f}x {gemms:12.3f} "
              f"{'/'.join('%.2f' % casts[t] for t in tensors):>17} {'/'.join('%.0f' % gbs[t] for t in tensors):>16}")
        del x, dy
        torch.cuda.empty_cache()
    total = {kind: sum(r["ms"].get(kind, float("nan")) for r in rows[:4]) for kind in rows[0]["ms"]}
    print("one layer's four linears (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in total.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows, layer_ms=total),
                      f, indent=1)


if __name__ == "__main__":
    main()
