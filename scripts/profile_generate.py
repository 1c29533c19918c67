"""Where mfsdp-generate's decode time goes on one GPU (issue 29): the gpt preset with random weights
(no checkpoint needed), batch 1, bf16, for each setting of the decode step (below):
tokens/s of graph replays, then a kernel table of a few replays (torch.profiler, CUDA activity):
the kernels' summed GPU time per token against the wall time per token, and the top kernels.

    python3 scripts/profile_generate.py --preset 1.4b --max-len 1024 > profile.jsonl  # a line a setting, then all

Settings: `triton` is the fused kernels (models/llama/fused_decode.py, mfsdp-generate's default on
a GPU), with `+name=value` changes (scripts/decode_variants.py: `triton+pdl=0`, alias
`triton_nopdl`, launches without programmatic dependent launch; `triton+early=2+tune=0`, ...); the
rest are torch.compile's step under an Inductor config patched while it compiles: `shipped` is
`--decoder compile` as it is (torch's defaults: cuBLAS GEMVs); `cdt` is coordinate descent
tuning, which turns every [1, d] x [d, n] matmul into a tuned Triton reduction fused with its
neighbours (gpt-fast's setting); `autotune` (not in the default list: its compile takes minutes)
lets Inductor time cuBLAS against its Triton templates for every matmul shape and keep the faster.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import decode_variants  # noqa: E402  (this script's folder is on the path)


def kernel_table(torch, call, n: int, sync) -> dict:
    """Per call: the device kernels' summed time, their count, the wall time, and the top 15 kernels."""
    from collections import defaultdict

    with torch.inference_mode():
        for _ in range(3):
            call()
        sync()
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        sync()
        wall = (time.perf_counter() - t0) / n
        acts = [torch.profiler.ProfilerActivity.CUDA if torch.cuda.is_available() else torch.profiler.ProfilerActivity.CPU]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(n):
                call()
            sync()
    kernels = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if not torch.cuda.is_available() or ev.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[ev.name]
            k[0] += getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0)
            k[1] += 1
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:15]
    return {"wall_us": round(wall * 1e6, 1), "kernel_us": round(sum(v[0] for v in kernels.values()) / n, 1),
            "kernels": sum(v[1] for v in kernels.values()) / n,
            "top": [{"kernel": k[:110], "us": round(v[0] / n, 2), "calls": v[1] / n} for k, v in top]}


def _tiles() -> dict:
    """The tile each fused kernel's autotuner picked, per shape key."""
    from mfsdp_launch.models.llama import decode_kernels

    out = {}
    for name in ("gemv", "swiglu", "qkv_rope_cache"):
        for key, cfg in getattr(getattr(decode_kernels, name), "cache", {}).items():
            out[f"{name}{list(key)[:4]}"] = f"{cfg.kwargs} w{cfg.num_warps} s{cfg.num_stages}"
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="1.4b")
    p.add_argument("--max-len", type=int, default=1024, help="the cache length (prompt + new tokens)")
    p.add_argument("--tokens", type=int, default=512, help="timed replays per setting")
    p.add_argument("--profile-tokens", type=int, default=8)
    p.add_argument("--settings", default="triton,shipped")
    p.add_argument("--device", default="cuda", help="cuda (cpu only checks this script)")
    args = p.parse_args(argv)

    import torch

    dev = torch.device(args.device)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    import torch._inductor.config as inductor_config

    from mfsdp_launch.models.llama.dims import resolve_gpt_dims
    from mfsdp_launch.models.llama.gpt_modules import GPT
    from mfsdp_launch.models.llama.kv_cache import decode_step
    from mfsdp_launch.models.llama.fused_decode import FusedDecoder
    from mfsdp_launch.tools.generate import graphed_decoder

    settings = {"shipped": {}, "cdt": {"coordinate_descent_tuning": True},
                "autotune": {"max_autotune": True, "max_autotune_gemm_backends": "ATEN,TRITON"}}
    torch.manual_seed(0)
    dims = resolve_gpt_dims(SimpleNamespace(preset=args.preset))
    with dev:
        model = GPT(dims, dtype=torch.bfloat16).eval()
    weight_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    out = {"preset": args.preset, "max_len": args.max_len, "weight_gb": round(weight_bytes / 1e9, 3),
           "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__, "rows": []}
    from mfsdp_launch.models.llama import decode_kernels

    for name in args.settings.split(","):
        torch._dynamo.reset()
        base, changes = decode_variants.parse(name)
        fused = base == "triton"
        undo = decode_variants.apply(changes)  # read by FusedDecoder at construction and launch
        for kernel in (decode_kernels.gemv, decode_kernels.swiglu, decode_kernels.qkv_rope_cache):
            kernel.cache.clear()  # each setting from the autotuner's own tiles (kept on disk: no re-timing)
        t0 = time.perf_counter()
        with inductor_config.patch(settings.get(name, {})):  # the step compiles and is captured in here
            step, cache = graphed_decoder(model, args.max_len, "triton" if fused else "compile")
        compile_s = time.perf_counter() - t0
        token = torch.ones((1, 1), dtype=torch.long, device=dev)
        pos = torch.tensor(args.max_len // 2, device=dev)
        with torch.inference_mode():
            for _ in range(10):
                step(model, token, pos, cache)
            sync()
            t0 = time.perf_counter()
            for _ in range(args.tokens):
                logits = step(model, token, pos, cache)
                token = logits[:, -1].argmax(-1, keepdim=True)  # as generate_gpt's greedy loop
            sync()
            wall = (time.perf_counter() - t0) / args.tokens
        row = {"setting": name, "inductor": settings.get(name, {}), "compile_s": round(compile_s, 1),
               "tokens_per_s": round(1 / wall, 1), "ms_per_token": round(wall * 1e3, 4),
               "hbm_tb_s_at_wall": round(weight_bytes / wall / 1e12, 2)}
        # mfsdp-generate's greedy path: the graphs with the argmax fed back (GreedyLoop), chunks of
        # check_every tokens a replay, from pos max_len/2 on (so later positions than the replays above).
        row["greedy_tokens_per_s"] = None  # no graphs off the GPU
        greedy_tokens = min(args.tokens, args.max_len - args.max_len // 2)  # within the cache
        if hasattr(step, "greedy"):
            with torch.inference_mode():
                first = torch.zeros(1, dims.vocab_size, device=dev)
                sync()
                t0 = time.perf_counter()
                step.greedy.run(first, pos, greedy_tokens, None)
                sync()
                row["greedy_tokens_per_s"] = round(greedy_tokens / (time.perf_counter() - t0), 1)
        # The replays' kernels (CUPTI may show a captured graph's kernels or only the graph), then the
        # same compiled step launched without the graph (its kernels one by one).
        row["graph"] = kernel_table(torch, lambda: step(model, token, pos, cache), args.profile_tokens, sync)
        if fused:
            bare = FusedDecoder(model, cache)
            row["pdl"], row["changes"] = bare.pdl, changes
            row["graph_tiles"] = getattr(getattr(step, "step", step), "tiles", {})  # decode_tuning's choice
            row["tiles"] = _tiles()
        else:
            bare = torch.compile(decode_step, fullgraph=True)
        with inductor_config.patch(settings.get(name, {})):  # torch.compile compiles at the first call, in here
            row["no_graph"] = kernel_table(torch, lambda: bare(model, token, pos, cache), args.profile_tokens, sync)
        undo()
        out["rows"].append(row)
        print(json.dumps(row), flush=True)  # row by row: a call that runs out of time keeps the rows done
        print(f"{name}: {row['tokens_per_s']} tokens/s (greedy loop {row['greedy_tokens_per_s']}), "
              f"{row['ms_per_token']} ms/token, compile "
              f"{row['compile_s']} s; graph kernels {row['graph']['kernel_us']} us in {row['graph']['kernels']}; "
              f"no graph {row['no_graph']['wall_us']} us wall, kernels {row['no_graph']['kernel_us']} us in "
              f"{row['no_graph']['kernels']}", file=sys.stderr, flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
