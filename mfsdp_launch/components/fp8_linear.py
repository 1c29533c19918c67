"""fp8.recipe=fused_rowwise: rowwise-scaled FP8 training of plain `nn.Linear` layers with the
launcher's own casts (fp8_casts.py), no Transformer Engine and no torchao.

A linear y = x W^T runs three FP8 GEMMs (torch._scaled_mm, per-row and per-column scales):

    forward      y  = x  @ W^T   x scaled per token,          W per output channel
    grad input   dx = dy @ W     dy per token,                 W per input channel (its columns)
    grad weight  dW = dy^T @ x   dy per output channel,        x per input channel (over the tokens)

so each of x, W and dy is cast along both axes, by one pair of kernels each. Forward keeps only
what backward reads: x's and W's column casts, in FP8 (half the bytes of the bf16 x it replaces).
The numerics are torchao's ROWWISE recipe (fp8_casts.py; forward with fast accumulation, the
gradients without); the casts are what is faster. The converted layer keeps its class's
parameters, state-dict keys and `reset_parameters`.

fp8.cache_weight_casts=true: a step's weights do not change between its micro-batches, so each
layer keeps its weight's two casts in buffers of its own (uint8 and int32 bits, which a module's
`.to(dtype)` leaves alone; not in the state dict), written by the step's first micro-batch and read
by all of its micro-batches (`WeightCasts.fill`, set by the loop before each micro-batch). They are
rewritten only at the next step's first micro-batch, after every backward that reads them ran.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from .fp8_casts import cast_views, casts_into_op, casts_op, launch_casts


def _casts(t: torch.Tensor):
    # Under a torch.compile trace the custom op that convert() registered: one opaque node, the
    # same for every layer (AOTAutograd merges the casts of one tensor that several layers read,
    # as q/k/v projections do). Eagerly, the kernels themselves.
    if torch.compiler.is_compiling():
        return torch.ops.mfsdp_launch.fp8_rowwise_casts(t)
    return launch_casts(t)


def _mm(a, b, scale_a, scale_b, fast_accum: bool = False):
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16,
                            use_fast_accum=fast_accum)


class _RowwiseFP8Matmul(torch.autograd.Function):
    """x2d [M, K] @ weight [N, K]^T in FP8, returned in bfloat16; `weight_casts`: the weight's
    casts made before (fp8.cache_weight_casts), else they are made here."""

    @staticmethod
    def forward(ctx, x2d, weight, *weight_casts):
        xq, x_inv, xqt, xt_inv = _casts(x2d)
        wq, w_inv, wqt, wt_inv = weight_casts or _casts(weight)
        ctx.save_for_backward(xqt, xt_inv, wqt, wt_inv)
        ctx.weight_dtype = weight.dtype
        # Fast accumulation (no periodic promotion to fp32 inside the FP8 GEMM) in forward only, as
        # torchao's recipes: gradients keep full accumulation.
        return _mm(xq, wq.t(), x_inv[:, None], w_inv[None, :], fast_accum=True)

    @staticmethod
    def backward(ctx, dy):
        xqt, xt_inv, wqt, wt_inv = ctx.saved_tensors
        dq, d_inv, dqt, dt_inv = _casts(dy.contiguous())
        dx = _mm(dq, wqt.t(), d_inv[:, None], wt_inv[None, :]) if ctx.needs_input_grad[0] else None
        dw = _mm(dqt, xqt.t(), dt_inv[:, None], xt_inv[None, :]) if ctx.needs_input_grad[1] else None
        return (dx, (dw.to(ctx.weight_dtype) if dw is not None else None)) + (None,) * len(ctx.needs_input_grad[2:])


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias=None, weight_casts=()) -> torch.Tensor:
    """F.linear with the matmul in rowwise FP8; a token count that is not a multiple of 16 (the
    FP8 GEMMs' rule, and the grad-weight GEMM reduces over tokens) runs in high precision."""
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.shape[0] % 16:
        return nn.functional.linear(x, weight, bias)
    y = _RowwiseFP8Matmul.apply(x2d, weight, *weight_casts).to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
    return y + bias if bias is not None else y


class WeightCasts:
    """fp8.cache_weight_casts: whether the next micro-batch writes the layers' weight casts (the
    first of each step) or reads them. torch.compile guards on it: one graph for each."""

    fill = True

    @classmethod
    def before_micro_batch(cls, micro: int) -> None:
        cls.fill = micro == 0


_CACHE = ("fp8_weight_q", "fp8_weight_inv", "fp8_weight_qt", "fp8_weight_inv_t")


def _forward(self, x):
    if not hasattr(self, _CACHE[0]) or not torch.is_grad_enabled():  # (evaluation: the weights of now)
        return fp8_linear(x, self.weight, self.bias)
    bufs = [getattr(self, name) for name in _CACHE]
    casts = cast_views(*bufs)
    if WeightCasts.fill:
        # Into the buffers themselves, which every micro-batch then reads: casts made apart and
        # copied in would be a second copy of them, alive until this micro-batch's backward.
        # (The weight's gradient comes through fp8_linear's `weight`.)
        if torch.compiler.is_compiling():
            torch.ops.mfsdp_launch.fp8_rowwise_casts_into(self.weight.detach(), *bufs)
        else:
            launch_casts(self.weight.detach(), out=casts)
    return fp8_linear(x, self.weight, self.bias, weight_casts=casts)


_CLASSES = {}


def _fp8_class(cls: type) -> type:
    """A subclass of the layer's own class whose forward runs fp8_linear (one per class)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"RowwiseFP8{cls.__name__}", (cls,), {"forward": _forward})
    return _CLASSES[cls]


def convert(linears: Iterable[nn.Linear], cache_weight_casts: bool = False) -> None:
    """Turn each of `linears` into a rowwise FP8 layer in place (components/float8.py chooses them),
    with buffers for its weight's casts under `cache_weight_casts`, and register the casts' custom
    op, outside any torch.compile trace (traced, its registration would break the graph at every
    call)."""
    casts_op()
    if cache_weight_casts:
        casts_into_op()
    for m in linears:
        m.__class__ = _fp8_class(type(m))
        if cache_weight_casts:
            n, k = m.weight.shape
            shapes = ((n, k), (n,), (k, n), (k,))
            for name, shape, dtype in zip(_CACHE, shapes, (torch.uint8, torch.int32, torch.uint8, torch.int32)):
                m.register_buffer(name, torch.zeros(shape, dtype=dtype, device=m.weight.device), persistent=False)
