"""Job cases on Transformer Engine models beyond _jobs.py's (named "_te_jobs:FUNCTION" in a Job)."""

from __future__ import annotations

from typing import Optional

import torch

from _jobs import Context, build, engine_for, spec_of, toy_batch
from mfsdp_launch.engines.base import local_tensor, strip_prefixes
from mfsdp_launch.engines.megatron_wgrad_fusion import fusable_te_modules


def _grads_after(ctx: Context, variant: str, zero: str, main_grads: Optional[str], batches) -> dict:
    """Each parameter's reduced gradient after one backward per batch (the last one syncs)."""
    spec = spec_of("te_toy_fp8")
    m, _ = build(ctx, "te_toy_fp8", meta=False, seed=0)
    eng = engine_for(ctx, zero=zero, compute="bf16", main_grads=main_grads,
                     fuse_wgrad_accumulation=variant == "fused")
    m = eng.shard(m, spec, init_on_meta=False)
    if variant == "naive":  # TE's fusion under Megatron-FSDP's own overwrite flag, uncorrected
        for module in fusable_te_modules(m):
            module.fuse_wgrad_accumulation = True
    for i, batch in enumerate(batches):
        eng.set_grad_sync(m, i == len(batches) - 1)
        spec.loss(m, batch).backward()
    fused = sum(1 for module in fusable_te_modules(m) if module.fuse_wgrad_accumulation)
    grads = {strip_prefixes(n): local_tensor(p.grad).float().clone()
             for n, p in m.named_parameters() if p.grad is not None}
    return {"grads": grads, "fused": fused}


def wgrad_fusion(ctx: Context, zero: str, main_grads: Optional[str], micro_batches: int = 2):
    """engine.fuse_wgrad_accumulation against the unfused engine on the same batches: the largest
    gradient difference relative to the gradient's own largest value, per variant, and how many TE
    modules wrote into the buffer. "naive" fuses without the overwrite correction."""
    spec = spec_of("te_toy_fp8")
    batches = [toy_batch(spec, ctx, mbs=4, seed=100 + i) for i in range(micro_batches)]
    ref = _grads_after(ctx, "plain", zero, main_grads, batches)
    out = {"n_grads": len(ref["grads"])}
    for variant in ("fused", "naive"):
        got = _grads_after(ctx, variant, zero, main_grads, batches)
        worst, worst_name = 0.0, None
        for name, r in ref["grads"].items():
            g = got["grads"].get(name)
            diff = float("inf") if g is None else ((g - r).abs().max() / r.abs().max().clamp_min(1e-12)).item()
            if diff > worst:
                worst, worst_name = diff, name
        out[variant] = {"max_rel_diff": worst, "worst": worst_name, "fused_modules": got["fused"],
                        "missing": sorted(set(ref["grads"]) - set(got["grads"]))}
    torch.cuda.synchronize()
    return out
