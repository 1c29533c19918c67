"""The gpt's batch-1 decode step in Triton kernels (decode_kernels.py): five launches a layer, each
GEMV with the norm, RoPE, cache write, SiLU-mul or residual add beside it, and attention that
reads the cache only up to the position (flash-decoding over slices of it).

    step = FusedDecoder(model, cache)          # cache: kv_cache.KVCache, batch 1
    logits = step(model, next_ids, pos, cache)  # as kv_cache.decode_step: [1, 1, vocab]

Same signature and results as `kv_cache.decode_step` (same roundings; fp32 sums), with static
buffers and `pos` read on the device, so tools/generate.py captures it once in a CUDA graph.
`unsupported(model)` says why a model cannot take it (`--decoder auto` then decodes eagerly).
Under TRITON_INTERPRET=1 the kernels run on CPU tensors (the CPU tests do that).
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

from .gpt_modules import GPT, MLP, rope_inv_freq


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def unsupported(model, batch: int = 1) -> Optional[str]:
    """Why the fused step cannot decode `model`, or None when it can."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    if not isinstance(model, GPT):
        return "it decodes the built-in model=gpt only"
    d = model.dims
    if model.tok_emb.weight.device.type != "cuda" and not _interpreted():
        return "its Triton kernels need a GPU"
    if batch != 1:
        return f"it decodes one sequence, not {batch}"
    if not all(isinstance(layer.mlp, MLP) for layer in model.layers):
        return "mixture-of-experts layers have no fused kernel"
    if d.qk_norm:
        return "model.qk_norm has no fused kernel"
    if d.head_dim & (d.head_dim - 1) or d.head_dim < 16:
        return f"head_dim {d.head_dim} is not a power of two >= 16"
    return None


def _pdl(device) -> int:
    """The kernels' PDL mode on `device` (decode_kernels' module doc): AFTER_WAIT where the GPU and
    Triton have it (measured, bench/reports/2026-12-03-session19-*), else NO_PDL."""
    from . import decode_kernels as k

    has = device.type == "cuda" and k.gdc_wait is not None and torch.cuda.get_device_capability(device) >= (9, 0)
    return k.AFTER_WAIT if has else k.NO_PDL


class FusedDecoder:
    """One token per call through the fused kernels, into buffers it owns (see the module doc)."""

    BLOCK_L = 64  # cache positions per attention tile
    WAVES = 2  # attention programs: enough slices per head to fill the GPU this many times over
    # Weight blocks each GEMV requests before waiting on the previous kernel (1 or 2): two, with the
    # tiles re-picked in the graph (GRAPH_TUNE, decode_tuning.py), took mfsdp-generate on the 1.4b
    # from 1,004 to 1,021 tokens/s (bench/reports/2026-12-03-session20-*).
    EARLY = 2
    GRAPH_TUNE = True

    def __init__(self, model: GPT, cache):
        reason = unsupported(model, cache.keys[0].shape[0] if cache.keys else 1)
        if reason:
            raise ValueError(f"fused decode: {reason}")
        d, w = model.dims, model.tok_emb.weight
        self.dims = d
        new = dict(dtype=w.dtype, device=w.device)
        self.x = torch.empty(d.dim, **new)  # the residual stream, updated in place
        self.q = torch.empty(d.n_heads * d.head_dim, **new)
        self.attn = torch.empty(d.n_heads * d.head_dim, **new)
        self.ffn = torch.empty(model.layers[0].mlp.w_down.in_features if len(model.layers) else 1, **new)
        self.logits = torch.empty(1, 1, d.vocab_size, **new)
        # The same fp32 frequencies (and Llama-3 scaling) as the eager decoder's rope_cos_sin.
        self.inv_freq = rope_inv_freq(d.head_dim, d.rope_theta, d.rope_scaling, w.device)
        self.splits = self._splits(cache.max_len, w.device)
        f32 = dict(dtype=torch.float32, device=w.device)
        self.part_max = torch.empty(d.n_heads * self.splits, **f32)
        self.part_sum = torch.empty(d.n_heads * self.splits, **f32)
        self.part_acc = torch.empty(d.n_heads * self.splits, d.head_dim, **f32)
        self.slices_done = torch.zeros(d.n_heads, dtype=torch.int32, device=w.device)  # attention resets it
        # Programmatic dependent launch where the GPU has it (Hopper on).
        self.pdl = _pdl(w.device)
        self.launch = {"launch_pdl": True} if self.pdl else {}

    def _splits(self, max_len: int, device) -> int:
        """Cache slices per head: enough programs to fill the GPU WAVES times over, a power of two,
        and no more slices than tiles in the cache."""
        sms = 4 if device.type != "cuda" else torch.cuda.get_device_properties(device).multi_processor_count
        want = min(max(1, self.WAVES * sms // self.dims.n_heads), max(1, math.ceil(max_len / self.BLOCK_L)))
        return 1 << (want.bit_length() - 1)

    @torch.no_grad()
    def __call__(self, model: GPT, input_ids: torch.Tensor, pos: torch.Tensor, cache) -> torch.Tensor:
        import triton

        from . import decode_kernels as k

        d = self.dims
        hd, eps = d.head_dim, d.norm_eps
        torch.index_select(model.tok_emb.weight, 0, input_ids.view(-1), out=self.x.view(1, -1))
        heads = d.n_heads + 2 * d.n_kv_heads
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.attn, layer.mlp
            k.qkv_rope_cache[lambda m: (heads * triton.cdiv(hd // 2, m["B"]),)](
                self.x, layer.attn_norm.weight, attn.wqkv.weight, self.inv_freq, pos, self.q, cache.keys[i],
                cache.values[i], d.dim, eps, cache.max_len, N_HEADS=d.n_heads, N_KV=d.n_kv_heads, HEAD_DIM=hd,
                PDL=self.pdl, EARLY=self.EARLY, **self.launch)
            k.attention[(d.n_heads, self.splits)](
                self.q, cache.keys[i], cache.values[i], pos, self.part_max, self.part_sum, self.part_acc,
                self.slices_done, self.attn, cache.max_len, 1.0 / math.sqrt(hd), GROUP=d.n_heads // d.n_kv_heads,
                HEAD_DIM=hd, SPLITS=self.splits, BLOCK_L=self.BLOCK_L, PDL=self.pdl, **self.launch)
            self._gemv(self.attn, None, attn.wo.weight, self.x)
            n_ffn = self.ffn.numel()
            k.swiglu[lambda m: (triton.cdiv(n_ffn, m["B"]),)](
                self.x, layer.mlp_norm.weight, mlp.w_gate_up.weight, self.ffn, n_ffn, d.dim, eps, PDL=self.pdl,
                EARLY=self.EARLY, **self.launch)
            self._gemv(self.ffn, None, mlp.w_down.weight, self.x)
        self._gemv(self.x, model.norm.weight, model.head_weight, self.logits, residual=False)
        return self.logits

    def tune(self, model: GPT, input_ids: torch.Tensor, pos: torch.Tensor, cache) -> dict:
        """The tiles decode_tuning picks for this step as a CUDA graph replays it at `pos` (a GPU;
        every shape autotuned by a first call), {shape: tile}; {} when GRAPH_TUNE is off."""
        if not self.GRAPH_TUNE:
            return {}
        from .decode_tuning import tune_in_graph

        return tune_in_graph(lambda: self(model, input_ids, pos, cache),
                             extra=f"pdl{self.pdl} early{self.EARLY} block_l{self.BLOCK_L} splits{self.splits}")

    def greedy_next(self, logits: torch.Tensor, token: torch.Tensor, ids: torch.Tensor, count: torch.Tensor,
                    pos: torch.Tensor) -> None:
        """GreedyLoop's bookkeeping after a step in one kernel: token = argmax(logits), ids[count] =
        token, pos and count + 1 (instead of five small torch kernels a token)."""
        import triton

        from .decode_kernels import greedy_next

        vocab = logits.shape[-1]
        greedy_next[(1,)](logits, token, pos, ids, count, vocab, BLOCK=min(triton.next_power_of_2(vocab), 32768),
                          num_warps=16)

    def _gemv(self, x, norm_weight, weight, out, residual: bool = True) -> None:
        """out = weight @ (RMSNorm(x) if norm_weight is given else x), plus out under `residual`."""
        import triton

        from .decode_kernels import gemv

        n, kdim = weight.shape
        gemv[lambda m: (triton.cdiv(n, m["R"]),)](
            x, weight if norm_weight is None else norm_weight, weight, out, n, kdim, self.dims.norm_eps,
            NORM=norm_weight is not None, RESIDUAL=residual, PDL=self.pdl, EARLY=self.EARLY, **self.launch)
