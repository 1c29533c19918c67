"""The Llama family's mixture-of-experts MLP: token-choice top-k routing over grouped SwiGLU experts.

    y = sum over the token's top_k experts e of  weight_e * expert_e(x)   (+ shared_expert(x))

* `Router`: logits = x @ W^T (fp32 softmax or sigmoid). Softmax: top-k of the probabilities.
  Sigmoid: top-k of score + `expert_bias`, a buffer that moves toward equal loads after every step
  (DeepSeek-V3's auxiliary-loss-free balancing; `moe_stats.after_step`). Either way the chosen
  experts' scores are renormalized to sum to 1 (Qwen3-MoE's norm_topk_prob, Mixtral).
* `GroupedExperts`: the experts' weights as two 3-D tensors in Hugging Face Qwen3-MoE's layout,
  w_gate_up [E, 2 * ffn, dim] ([gate; up] rows) and w_down [E, dim, ffn]. The tokens, sorted by
  expert, run through one grouped GEMM per weight (`torch._grouped_mm`) on CUDA in bf16 (in FP8
  under fp8.recipe=torchao_*: models/llama/moe_fp8.py), a padded batched GEMM on CUDA otherwise,
  and a plain loop over the experts on the CPU: never one kernel per expert on the GPU.
* Dispatch: locally, or over the expert-parallel group with all-to-all when mesh.ep > 1
  (models/llama/expert_parallel.py sets `MoE.dispatcher`).
* Losses: in training each forward stashes `aux_loss` = aux_loss_coef * the Switch load-balancing
  loss (E * sum_e f_e * P_e over this micro-batch's tokens: 1 when balanced) + z_loss_coef * the
  router z-loss; `moe_loss` adds its gradient to the training loss (models/llama/moe_stats.py).
  Load counts are per rank's own tokens, so nothing depends on how experts are split over ranks.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...components.profile_ranges import MOE as MOE_RANGE, profiled
from ...core.fp8_flops import fp8_shape
from ..moe_metrics import in_recompute
from . import moe_fp8
from .dims import GPTDims
from .moe_dims import expert_capacity

INIT_STD = 0.02
BUFFERS = ("expert_bias", "load", "aux_sum")


class Router(nn.Module):
    """Scores, top-k choice and the balancing state of one MoE layer. It owns its weight (and the
    buffers) directly, so Megatron-FSDP's meta-device init, which calls `reset_parameters` on the
    modules holding parameters, resets the buffers too."""

    def __init__(self, dim: int, experts: int, top_k: int, kind: str, **kw):
        super().__init__()
        self.experts, self.top_k, self.kind = experts, top_k, kind
        self.weight = nn.Parameter(torch.empty(experts, dim, **kw))
        device = kw.get("device")
        # Sigmoid routing's balancing bias: saved in checkpoints, the same on every rank.
        self.register_buffer("expert_bias", torch.zeros(experts, dtype=torch.float32, device=device),
                             persistent=kind == "sigmoid")
        # This step's routed tokens per expert (this rank's), and the sum of its aux losses.
        self.register_buffer("load", torch.zeros(experts, dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("aux_sum", torch.zeros(2, dtype=torch.float32, device=device), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=INIT_STD)
        with torch.no_grad():
            for b in (self.expert_bias, self.load, self.aux_sum):
                if b.device.type != "meta":
                    b.zero_()

    def _apply(self, fn, recurse=True):
        # The buffers stay fp32 when the model is cast (Megatron-FSDP casts it to the compute
        # dtype): a bf16 token count stops at 256, a bf16 bias cannot take 1e-3 steps.
        out = super()._apply(fn, recurse)
        for name in BUFFERS:
            b = self._buffers.get(name)
            if b is not None and b.dtype != torch.float32:
                self._buffers[name] = b.float()
        return out

    def forward(self, x: torch.Tensor):
        """x [N, dim] -> (weights [N, k] fp32, experts [N, k], logits [N, E] fp32, probs [N, E] fp32)."""
        logits = F.linear(x, self.weight).float()
        if self.kind == "sigmoid":
            scores = torch.sigmoid(logits)
            with torch.no_grad():  # the bias picks the experts; the weights come from the scores alone
                chosen = torch.topk(scores + self.expert_bias, self.top_k, dim=-1).indices
            top = scores.gather(-1, chosen)
            probs = scores / scores.sum(-1, keepdim=True)  # for the aux loss's P_e
        else:
            probs = torch.softmax(logits, dim=-1)
            top, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = top / top.sum(-1, keepdim=True)
        return weights, chosen, logits, probs


class GroupedExperts(nn.Module):
    """`experts` SwiGLU experts (the local ones under expert parallelism: the weights are then
    DTensors sharded over the ep mesh, and forward uses this rank's part)."""

    # Its parameters are expert parameters: Megatron-FSDP's expert mesh (engines/megatron_experts.py).
    is_expert_module = True
    # The grouped GEMMs in FP8 (models/llama/moe_fp8.py): enable_fp8, under fp8.recipe=torchao_*.
    fp8 = False

    def __init__(self, experts: int, dim: int, ffn: int, out_std: float, **kw):
        super().__init__()
        self.out_std = out_std
        # Under mesh.ep > 1 (models/llama/expert_parallel.py): the mesh of the experts' own
        # fully_shard, and the factor on their gradients.
        self.fsdp_mesh = None
        self.grad_scale = 1.0
        self.w_gate_up = nn.Parameter(torch.empty(experts, 2 * ffn, dim, **kw))
        self.w_down = nn.Parameter(torch.empty(experts, dim, ffn, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.w_gate_up, mean=0.0, std=INIT_STD)
        nn.init.normal_(self.w_down, mean=0.0, std=self.out_std)

    def enable_fp8(self) -> bool:
        """Run the grouped GEMMs in FP8 on CUDA (components/float8.py calls it); False, and stay in
        high precision, where a dimension is not a multiple of the FP8 GEMMs' 16 (the rule
        mfu_at_precision counts by)."""
        self.fp8 = fp8_shape(*self.w_down.shape[1:])  # (dim, ffn)
        return self.fp8

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [A, dim], rows grouped by local expert (`counts` [E_local] rows each) -> [A, dim]."""
        return run_local_experts(x, counts, self.w_gate_up, self.w_down, self.grad_scale, fp8=self.fp8)


def run_local_experts(x: torch.Tensor, counts: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                      grad_scale: float = 1.0, fp8: bool = False) -> torch.Tensor:
    """SwiGLU experts in Qwen3-MoE's layout (w_gate_up [E, 2 * ffn, dim], [gate; up] rows; w_down
    [E, dim, ffn]) on rows grouped by expert; DTensor weights (over the ep mesh) give this rank's
    experts, their gradients times `grad_scale` (models/expert_parallel.py)."""
    w1, w2 = w_gate_up, w_down
    if hasattr(w1, "to_local"):  # a DTensor over the ep mesh: this rank's experts
        w1, w2 = w1.to_local(), w2.to_local()
    if grad_scale != 1.0:
        w1, w2 = _ScaleGrad.apply(w1, grad_scale), _ScaleGrad.apply(w2, grad_scale)
    return run_experts(x, counts, w1, w2, fp8=fp8)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times `scale` in backward."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def run_experts(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                fp8: bool = False) -> torch.Tensor:
    if x.shape[0] == 0:
        return _no_rows(x, w1, w2)
    if fp8 and moe_fp8.fp8_applies(x, w1, w2):
        return moe_fp8.run_fp8(x, counts, w1, w2, _swiglu)
    if x.is_cuda and grouped_mm_applies(x, w1, w2):
        # The group sizes are data (the offsets), the shapes are not: torch.compile traces it with
        # the block around it (as torchtitan's MoE), no graph break.
        return _grouped(x, counts, w1, w2)
    return _data_sized(x, counts, w1, w2)


@torch.compiler.disable  # shapes from the counts' values: compiled blocks stay static around it
def _data_sized(x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    if x.is_cuda:
        return _padded_bmm(x, counts, w1, w2)
    return _loop(x, counts, w1, w2)


def grouped_mm_applies(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """torch._grouped_mm takes bf16 operands whose rows are 16-byte aligned (dims multiple of 8)."""
    return (hasattr(torch, "_grouped_mm") and x.dtype == w1.dtype == w2.dtype == torch.bfloat16
            and all(n % 8 == 0 for n in (*w1.shape[1:], w2.shape[1], w2.shape[2])))


def _swiglu(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def _grouped(x, counts, w1, w2):
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    h = _swiglu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets))
    return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offsets)


def _no_rows(x, w1, w2):
    """No token reached these experts: zeros that still depend on the weights and on `x`, so
    every rank runs the same backward: the experts' (zero) gradients for FSDP to reduce, and the
    all-to-all's backward exchange that brought `x` (skipped on one rank, it hangs the others)."""
    return x * 0.0 + 0.0 * (w1.sum() + w2.sum()).to(x.dtype)


def _padded_bmm(x, counts, w1, w2):
    """One batched GEMM per weight over [E, max_count, dim], each expert's rows zero-padded (CUDA
    without a bf16 grouped GEMM)."""
    E = w1.shape[0]
    width = int(counts.max()) if counts.numel() else 0
    if width == 0:
        return _no_rows(x, w1, w2)
    starts = torch.cumsum(counts, 0) - counts
    row = torch.arange(x.shape[0], device=x.device)
    expert = torch.repeat_interleave(torch.arange(E, device=x.device), counts, output_size=x.shape[0])
    slot = row - starts[expert]
    padded = x.new_zeros(E, width, x.shape[1]).index_put((expert, slot), x)
    out = torch.bmm(_swiglu(torch.bmm(padded, w1.transpose(-2, -1))), w2.transpose(-2, -1))
    return out[expert, slot]


def _loop(x, counts, w1, w2):
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            outs.append(_swiglu(x[start:start + n] @ w1[e].T) @ w2[e].T)
            start += n
    return torch.cat(outs) if outs else _no_rows(x, w1, w2)


class MoE(nn.Module):
    """Router, grouped experts and the optional shared expert of one Block (its `mlp`)."""

    def __init__(self, d: GPTDims, out_std: float, shared: Optional[nn.Module] = None, **kw):
        """`shared`: the shared expert (Block builds it: a SwiGLU MLP of shared_experts * ffn_dim)."""
        super().__init__()
        m = d.moe
        self.cfg = m
        self.router = Router(d.dim, m.experts, m.top_k, m.router, **kw)
        self.experts = GroupedExperts(m.experts, d.dim, m.ffn_dim, out_std, **kw)
        self.shared = shared
        # Set by models/llama/expert_parallel.py under mesh.ep > 1: sends tokens to the ranks
        # holding their experts and back.
        self.dispatcher = None
        self.aux_loss: Optional[torch.Tensor] = None  # this micro-batch's weighted aux + z loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        # train.profile: the layer's forward and backward as named ranges (components/profile_ranges.py)
        return profiled(MOE_RANGE, x.reshape(-1, shape[-1]), self._forward, in_recompute).view(shape)

    def _forward(self, flat: torch.Tensor) -> torch.Tensor:
        weights, chosen, logits, probs = self.router(flat)
        counts = expert_counts(chosen, self.cfg.experts)
        y = self.route(flat, weights, chosen, counts)
        if self.shared is not None:
            y = y + self.shared(flat)
        if self.training and torch.is_grad_enabled():
            # Computed in a checkpointed block's recompute too (the same saved tensors), kept once.
            aux_loss, aux = self._losses(counts, logits, probs)
            self._account(counts, aux_loss, aux)
        return y

    def _losses(self, counts: torch.Tensor, logits: torch.Tensor, probs: torch.Tensor):
        """(the weighted balancing losses of this micro-batch or None, the Switch loss itself)."""
        m = self.cfg
        frac = counts.float() / max(probs.shape[0] * m.top_k, 1)  # f_e: the share of routed slots
        aux = m.experts * (frac * probs.mean(0)).sum()  # 1 when perfectly balanced
        if not (m.aux_loss_coef or m.z_loss_coef):
            return None, aux
        z = torch.logsumexp(logits, dim=-1).pow(2).mean() if m.z_loss_coef else 0.0
        return m.aux_loss_coef * aux + m.z_loss_coef * z, aux

    @torch.compiler.disable  # state kept across calls, and the recompute test: the forward's one graph break, last
    def _account(self, counts: torch.Tensor, aux_loss, aux: torch.Tensor) -> None:
        """Keep the balancing losses for the loss (models/llama/moe_stats.py) and this
        micro-batch's load (metrics, the sigmoid router's bias), once: not again in a
        checkpointed block's recompute."""
        if in_recompute():
            return
        r = self.router
        self.aux_loss = aux_loss
        with torch.no_grad():
            r.load += counts.float()
            r.aux_sum += torch.stack([aux.detach(), torch.ones((), device=aux.device)])

    def route(self, flat: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
              counts: torch.Tensor) -> torch.Tensor:
        """Each token through its experts, weighted and summed back ([N, dim] -> [N, dim])."""
        experts = self.experts if self.dispatcher is None else partial(self.dispatcher.run, experts=self.experts)
        return route_tokens(flat, weights, chosen, counts, experts, expert_capacity(flat.shape[0], self.cfg))


def expert_counts(chosen: torch.Tensor, experts: int) -> torch.Tensor:
    """Routed slots per expert ([experts], int64) of the top-k choices `chosen` [N, k]. A
    scatter-add, not bincount, whose output size depends on the values (a graph break)."""
    flat = chosen.flatten()
    return torch.zeros(experts, dtype=torch.long, device=chosen.device).scatter_add_(0, flat, torch.ones_like(flat))


def route_tokens(flat: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, counts: torch.Tensor,
                 experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 capacity: Optional[int] = None) -> torch.Tensor:
    """flat [N, dim], each token's top-k `weights` and `chosen` experts [N, k], `counts` [E] ->
    [N, dim]: the (token, slot) rows sorted by expert through `experts(rows, counts)` (local, or
    an all-to-all dispatcher's), weighted and summed back per token. `capacity`: slots per expert
    (None: dropless)."""
    k = chosen.shape[-1]
    order = torch.argsort(chosen.flatten(), stable=True)  # (token, slot) pairs grouped by expert
    if capacity is not None:
        order, counts = _within_capacity(order, chosen.flatten(), counts, capacity)
    token = order // k
    out = experts(flat[token], counts)
    out = out * weights.flatten()[order].unsqueeze(-1).to(out.dtype)
    return torch.zeros_like(flat).index_add_(0, token, out)


def _within_capacity(order: torch.Tensor, flat_chosen: torch.Tensor, counts: torch.Tensor, capacity: int):
    """Keep each expert's first `capacity` (token, slot) pairs in token order; drop the rest."""
    starts = torch.cumsum(counts, 0) - counts
    position = torch.arange(order.numel(), device=order.device) - starts[flat_chosen[order]]
    keep = position < capacity
    return order[keep], counts.clamp(max=capacity)


def moe_layers(model: nn.Module) -> List[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]
