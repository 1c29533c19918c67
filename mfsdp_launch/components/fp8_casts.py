"""Rowwise FP8 casts of a 2-D tensor along both of its axes, in two Triton kernels.

A rowwise FP8 linear needs each of its three tensors (input, weight, output gradient) twice: scaled
per row for one GEMM and per column, transposed, for another (fp8_linear.py says which). torchao
computes each as its own amax reduction and cast; on one H100 the 8B slice's step spent 67 ms in
those compiled casts against 15 ms of bf16 elementwise work, giving back 53 of the 69 ms the FP8
GEMMs saved (session 29's profile). Here one pass reads the tensor for both amaxes (atomic maxima
per row and per column) and a second reads it again and writes both casts: 6 bytes moved per
element, 20.3 ms a step at that shape (session 31).

The numerics are torchao's ROWWISE recipe: E4M3, scales 448 / amax rounded down to a power of
two (clearing the mantissa bits, exact where torchao's exp2(floor(log2)) may round), amax clamped
at 1e-12, values saturated at +-448. Under TRITON_INTERPRET=1 the kernels run on CPU tensors.
"""

from __future__ import annotations

import functools
import inspect
import os
from typing import Tuple

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0
AMAX_EPS = 1e-12
_MAX = tl.constexpr(E4M3_MAX)  # (the kernels' view of the same two numbers)
_EPS = tl.constexpr(AMAX_EPS)

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Tiles timed per tensor shape at its first cast (triton.autotune); the interpreter gets one small
# tile, whose edges the CPU tests' odd shapes cross. The amax pass walks GROUP row blocks a
# program, so a column's maximum takes one atomic per GROUP blocks.
_KEEP = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
if _INTERPRET:
    _AMAX_CONFIGS = [triton.Config({"BM": 16, "BN": 32, "GROUP": 2}, num_warps=4)]
    _CAST_CONFIGS = [triton.Config({"BM": 16, "BN": 32}, num_warps=4)]
else:
    _AMAX_CONFIGS = [triton.Config({"BM": bm, "BN": bn, "GROUP": g}, num_warps=w)
                     for bm, bn, g, w in [(64, 128, 1, 4), (64, 128, 4, 4), (32, 256, 4, 4), (64, 256, 2, 8),
                                          (128, 128, 2, 8), (32, 128, 8, 4), (16, 512, 4, 4), (64, 64, 8, 4)]]
    _CAST_CONFIGS = [triton.Config({"BM": bm, "BN": bn}, num_warps=w)
                     for bm, bn, w in [(64, 128, 4), (64, 128, 8), (128, 128, 8), (128, 64, 4), (64, 256, 8),
                                       (128, 256, 8), (32, 128, 4), (128, 128, 4)]]


@triton.jit
def _pow2_scale(amax):
    s = _MAX / tl.maximum(amax, _EPS)
    # Round down to a power of two: keep the exponent bits (s is a positive normal float32).
    return (s.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def _to_e4m3(v, ROUND: tl.constexpr):
    # The interpreter's float32 -> E4M3 conversion rounds ties away and loses carries into the
    # exponent (124.5 -> 64); there the value is first rounded to nearest-even in float32, as the
    # GPU's conversion does, so that the conversion is exact.
    if ROUND:
        bits = v.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
        small = (tl.abs(v) + 24576.0) - 24576.0  # subnormals: steps of 2^-9, the sign kept (-0 too)
        v = tl.where(tl.abs(v) < 0.015625, tl.where(bits < 0, -small, small), normal)
    return v.to(tl.float8e4nv)


@triton.autotune(configs=_AMAX_CONFIGS, key=["M", "N"], **_KEEP)
@triton.jit
def _amax_kernel(x_ptr, row_amax_ptr, col_amax_ptr, M, N, stride_m, BM: tl.constexpr, BN: tl.constexpr,
                 GROUP: tl.constexpr):
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    col_ok = cols < N
    col_max = tl.zeros([BN], dtype=tl.float32)
    for i in range(GROUP):
        rows = (tl.program_id(0) * GROUP + i) * BM + tl.arange(0, BM)
        mask = (rows[:, None] < M) & col_ok[None, :]
        # |x| and its maxima are exact in x's own dtype: widen only the reduced vectors
        x = tl.abs(tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_m + cols[None, :], mask=mask, other=0.0))
        # Relaxed: a maximum needs no order, and the kernel's end publishes it to the cast pass. Triton's
        # default (acquire-release) returns a value and orders each block's loads after the atomic before.
        tl.atomic_max(row_amax_ptr + rows, tl.max(x, 1).to(tl.float32), mask=rows < M, sem="relaxed")
        col_max = tl.maximum(col_max, tl.max(x, 0).to(tl.float32))
    tl.atomic_max(col_amax_ptr + cols, col_max, mask=col_ok, sem="relaxed")


@triton.autotune(configs=_CAST_CONFIGS, key=["M", "N"], **_KEEP)
@triton.jit
def _cast_kernel(x_ptr, row_amax_ptr, col_amax_ptr, q_ptr, qt_ptr, row_inv_ptr, col_inv_ptr, M, N, stride_m,
                 ROUND: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_m + cols64[None, :], mask=mask, other=0.0).to(tl.float32)
    row_scale = _pow2_scale(tl.load(row_amax_ptr + rows, mask=row_ok, other=1.0))
    col_scale = _pow2_scale(tl.load(col_amax_ptr + cols, mask=col_ok, other=1.0))
    q = tl.clamp(x * row_scale[:, None], -_MAX, _MAX)
    tl.store(q_ptr + rows64[:, None] * N + cols64[None, :], _to_e4m3(q, ROUND), mask=mask)
    qt = tl.trans(tl.clamp(x * col_scale[None, :], -_MAX, _MAX))  # [BN, BM]: row n of qt is column n of x
    tl.store(qt_ptr + cols64[:, None] * M + rows64[None, :], _to_e4m3(qt, ROUND), mask=tl.trans(mask))
    if pid_n == 0:
        tl.store(row_inv_ptr + rows, 1.0 / row_scale, mask=row_ok)
    if pid_m == 0:
        tl.store(col_inv_ptr + cols, 1.0 / col_scale, mask=col_ok)


def launch_casts(x: torch.Tensor, out=None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, N] (last dim contiguous) -> (q [M, N] scaled per row, row_inv [M], qt [N, M] = x's
    columns scaled per column, col_inv [N]): E4M3 data and the fp32 factors that undo the scales
    (what torch._scaled_mm takes), written into `out` (the same four, contiguous) when given."""
    if x.stride(1) != 1:  # the kernels walk rows of contiguous elements
        x = x.contiguous()
    M, N = x.shape
    row_amax = torch.zeros(M, dtype=torch.float32, device=x.device)
    col_amax = torch.zeros(N, dtype=torch.float32, device=x.device)
    if out is None:
        fp8, fp32 = torch.float8_e4m3fn, torch.float32
        out = (torch.empty((M, N), dtype=fp8, device=x.device), torch.empty(M, dtype=fp32, device=x.device),
               torch.empty((N, M), dtype=fp8, device=x.device), torch.empty(N, dtype=fp32, device=x.device))
    q, row_inv, qt, col_inv = out
    # (the maxima are the same however often autotune reruns the pass: atomic maxima of the same values)
    _amax_kernel[lambda meta: (triton.cdiv(M, meta["BM"] * meta["GROUP"]), triton.cdiv(N, meta["BN"]))](
        x, row_amax, col_amax, M, N, x.stride(0))
    _cast_kernel[lambda meta: (triton.cdiv(M, meta["BM"]), triton.cdiv(N, meta["BN"]))](
        x, row_amax, col_amax, q, qt, row_inv, col_inv, M, N, x.stride(0), ROUND=_INTERPRET)
    return q, row_inv, qt, col_inv


@functools.lru_cache(maxsize=None)
def casts_op():
    """The casts as a torch custom op (registered at first use, not at import): torch.compile
    keeps it as one opaque call in the graphs it builds around it."""

    @torch.library.custom_op("mfsdp_launch::fp8_rowwise_casts", mutates_args=())
    def fp8_rowwise_casts(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return launch_casts(x)

    @fp8_rowwise_casts.register_fake
    def _(x):
        M, N = x.shape
        fp8 = torch.float8_e4m3fn
        return (x.new_empty((M, N), dtype=fp8), x.new_empty(M, dtype=torch.float32),
                x.new_empty((N, M), dtype=fp8), x.new_empty(N, dtype=torch.float32))

    return fp8_rowwise_casts


def cast_views(q: torch.Tensor, row_inv: torch.Tensor, qt: torch.Tensor, col_inv: torch.Tensor):
    """A layer's cached-cast buffers (uint8 / int32: bits that a module's `.to(dtype)` leaves
    alone) as the casts they hold: E4M3 data and fp32 factors, in `launch_casts`' order."""
    fp8, fp32 = torch.float8_e4m3fn, torch.float32
    return q.view(fp8), row_inv.view(fp32), qt.view(fp8), col_inv.view(fp32)


@functools.lru_cache(maxsize=None)
def casts_into_op():
    """The casts written into a layer's own buffers (fp8.cache_weight_casts), as a custom op that
    mutates them: under torch.compile the kernels write the buffers themselves, so the step's first
    micro-batch holds no second copy of its weights' casts (the buffers: `cast_views`)."""

    @torch.library.custom_op("mfsdp_launch::fp8_rowwise_casts_into", mutates_args=("q", "row_inv", "qt", "col_inv"))
    def fp8_rowwise_casts_into(x: torch.Tensor, q: torch.Tensor, row_inv: torch.Tensor, qt: torch.Tensor,
                               col_inv: torch.Tensor) -> None:
        launch_casts(x, out=cast_views(q, row_inv, qt, col_inv))

    @fp8_rowwise_casts_into.register_fake
    def _(x, q, row_inv, qt, col_inv):
        return None

    return fp8_rowwise_casts_into


def reference_casts(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The same casts in plain torch (what the tests hold the kernels to)."""
    xf = x.float()

    def cast(t, dim):
        amax = t.abs().amax(dim=dim, keepdim=True)
        scale = E4M3_MAX / amax.clamp(min=AMAX_EPS)
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
        return (t * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale.reciprocal().flatten()

    q, row_inv = cast(xf, 1)
    qt, col_inv = cast(xf.t(), 1)
    return q, row_inv, qt.contiguous(), col_inv
