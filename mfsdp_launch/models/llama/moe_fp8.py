"""The MoE experts' grouped GEMMs in FP8 (fp8.recipe=torchao_*: components/float8.py turns it on
per GroupedExperts): torchao's differentiable rowwise-scaled FP8 grouped GEMM
(`_to_fp8_rowwise_then_scaled_grouped_mm`: e4m3 operands, power-of-2 scales per row of the tokens
and per column of each expert's weight, for the forward, the input gradient and the weight
gradient) on the same bf16 weights, so it works under either engine: the weights stay ordinary
parameters, quantized as each GEMM reads them.

The FP8 grouped GEMM needs every expert's group of rows to be a multiple of ALIGN. `pad_groups`
lays the tokens (sorted by expert) out with zero rows after each group (at least ALIGN rows per
expert), in a buffer whose size
depends only on the token count (torch.compile sees static shapes); the last expert's group
takes the slack, so no row of the buffer lies outside a group and every GEMM output row is
computed (zeros for padding) rather than left undefined."""

from __future__ import annotations

from typing import Tuple

import torch

from ...core.fp8 import FP8_GEMM_MULTIPLE

ALIGN = FP8_GEMM_MULTIPLE  # rows per expert group and every GEMM dimension: multiples of this


def padded_rows(tokens: int, experts: int) -> int:
    """The padded buffer's row count: room for every group rounded up to ALIGN, itself a multiple."""
    return -(-tokens // ALIGN) * ALIGN + experts * ALIGN


def pad_groups(x: torch.Tensor, counts: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [A, dim] (rows grouped by expert, counts [E]) -> (padded [padded_rows, dim], the padded row
    of each of x's rows [A], the groups' end offsets [E] int32 for the grouped GEMM)."""
    experts = counts.numel()
    size = padded_rows(x.shape[0], experts)
    # At least ALIGN rows each: an expert without tokens would give its weight-gradient GEMM an
    # empty reduction, which grouped kernels need not write (torchtitan pads the same way).
    sizes = ((counts + ALIGN - 1) // ALIGN * ALIGN).clamp(min=ALIGN)
    ends = torch.cumsum(sizes, 0)
    group_starts = ends - sizes
    ends[-1] = size  # the last group takes the slack (a multiple of ALIGN: both are)
    starts = torch.cumsum(counts, 0) - counts
    expert = torch.repeat_interleave(torch.arange(experts, device=x.device), counts, output_size=x.shape[0])
    rows = group_starts[expert] + torch.arange(x.shape[0], device=x.device) - starts[expert]
    padded = x.new_zeros(size, x.shape[1]).index_put((rows,), x)
    return padded, rows, ends.to(torch.int32)


def fp8_grouped_mm(a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """a [M, K] row-major (groups ending at `ends`, each a multiple of ALIGN) @ w[e]^T for w [E, N, K]."""
    from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm

    # w [E, N, K] contiguous: its transpose [E, K, N] is column-major per expert, as the GEMM wants
    return _to_fp8_rowwise_then_scaled_grouped_mm(a, w.transpose(-2, -1), ends, out_dtype=a.dtype,
                                                  pad_token_groups_for_grouped_mm=False)


def fp8_applies(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """CUDA and bf16 (GroupedExperts.enable_fp8 checked the dimensions when it turned FP8 on)."""
    return x.is_cuda and x.dtype == w1.dtype == w2.dtype == torch.bfloat16


def run_fp8(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, swiglu, mm=fp8_grouped_mm):
    """The SwiGLU experts on rows grouped by expert, both GEMMs in FP8 over one padded layout
    (`mm`: the grouped GEMM; a test passes a high-precision one to check the layout on CPU)."""
    padded, rows, ends = pad_groups(x, counts)
    return mm(swiglu(mm(padded, w1, ends)), w2, ends)[rows]
