"""The fused decode kernels' tiles picked as the CUDA graph replays them (tools/generate.py).

Triton's autotuner times each kernel alone, so it cannot see what programmatic dependent launch
makes of a tile: under PDL a kernel's programs start while the previous kernel's still run, if the
SM has registers left for them, and a tile that is fastest alone can hold the registers the next
kernel needed to start early. So after the autotuner, each kernel shape's tile is chosen again by
coordinate descent over the captured step's replay time: every tile of one shape in turn, the
others held, the fastest kept. The choice is kept in Triton's cache dir, so only the first process
that decodes a shape on a GPU pays its ~75 graph captures.
"""

from __future__ import annotations

import hashlib
import json
from typing import Callable, Dict, List, Tuple

KEEP_ABOVE = 0.005  # a tile replaces the current one only if the step gets this much faster (timing noise)


def _kernels():
    from . import decode_kernels

    return {name: getattr(decode_kernels, name) for name in ("gemv", "swiglu", "qkv_rope_cache")}


def _step_time(torch, launch: Callable[[], None], replays: int) -> float:
    """Seconds per replay of `launch` captured in a CUDA graph: the least of three timed batches."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for _ in range(3):
        graph.replay()
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / replays)
    return best


def _cache_key(torch, shapes: List[Tuple[str, tuple]], extra: str) -> str:
    import triton

    fns = _kernels()
    parts = [triton.__version__, torch.cuda.get_device_name(), extra]
    for name, key in shapes:
        fn = fns[name]
        while not hasattr(fn, "cache_key"):
            fn = fn.fn
        parts += [name, fn.cache_key, repr(key), repr([str(c) for c in fns[name].configs])]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()


def tune_in_graph(launch: Callable[[], None], extra: str = "", replays: int = 30) -> Dict[str, str]:
    """Re-pick, by the captured step's replay time, the tile of every shape that `launch` (one
    decode step, already run once, so every shape is autotuned) sends to the fused kernels.
    Returns {shape: tile} as chosen; `extra` names what else changes the kernels (PDL mode)."""
    import torch
    from triton.runtime.cache import get_cache_manager

    kernels = _kernels()
    shapes = [(name, key) for name, k in kernels.items() for key in list(getattr(k, "cache", {}))]
    if not shapes:
        return {}
    cache = get_cache_manager(_cache_key(torch, shapes, extra))
    kept = cache.get_file("graph_tiles.json")
    if kept:
        by_str = {name: {str(c): c for c in k.configs} for name, k in kernels.items()}
        with open(kept) as f:
            chosen = json.load(f)
        for name, key in shapes:
            cfg = by_str[name].get(chosen.get(f"{name}{key}"))
            if cfg is not None:
                kernels[name].cache[key] = cfg
        return chosen
    best = _step_time(torch, launch, replays)
    for name, key in shapes:
        kernel = kernels[name]
        current = kernel.cache[key]
        for cfg in kernel.configs:
            if str(cfg) == str(current):  # (the autotuner's pick read from its disk cache is a copy)
                continue
            kernel.cache[key] = cfg
            try:  # once outside a graph: a tile this shape cannot take (out of resources) raises here,
                launch()  # not inside a capture
            except Exception:
                continue
            t = _step_time(torch, launch, replays)
            if t < best * (1 - KEEP_ABOVE):
                best, current = t, cfg
        kernel.cache[key] = current
    chosen = {f"{name}{key}": str(kernels[name].cache[key]) for name, key in shapes}
    cache.put(json.dumps(chosen), "graph_tiles.json", binary=False)
    return chosen
