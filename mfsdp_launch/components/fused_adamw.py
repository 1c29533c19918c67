"""optim.impl=triton: AdamW in one Triton kernel a parameter, which reads each gradient in its own
dtype and writes it nowhere.

torch's fused AdamW takes gradients of the parameters' dtype only, so fp32 main weights need fp32
main gradients, and when it clips (GradScaler's `grad_scale`) it writes the divided gradient back.
Under Megatron-FSDP (engine.use_decoupled_grad=true, precision.main_grads_dtype=bf16) this kernel
reads the bf16 gradients where the engine reduced them: on one 1.4b step that is 10 bytes a
parameter less to accumulate, zero, norm and read (the grad buffer, its fill, the clip's norm,
the optimizer's read), and 4 less to write back. At one micro-batch a step on one GPU bf16 main
gradients hold exactly what autograd produced, so the update is torch's to float rounding; with
gradient accumulation or a reduction over ranks they round the sum to bf16 (precision's choice).

Like torch's fused kernel it divides each gradient by `grad_scale` (the clip's divisor,
components/optim.arm_device_step) and applies nothing where `found_inf` is 1: the parameters,
moments and step count stay as they were. Its state is torch.optim.AdamW's (per parameter: a
device `step`, `exp_avg`, `exp_avg_sq`; the same group keys), so a checkpoint resumes under either.
Under TRITON_INTERPRET=1 the kernel runs on CPU tensors (the tests)."""

from __future__ import annotations

import math
import os
from typing import List, Optional

import torch
import triton
import triton.language as tl

from .adamw import closure_loss, local, torch_adamw_defaults

BLOCK = 1024 if os.environ.get("TRITON_INTERPRET") != "1" else 64


@triton.jit
def _adamw_kernel(param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, step_ptr, scale_ptr, skip_ptr, n,
                  lr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay,
                  HAS_SCALE: tl.constexpr, HAS_SKIP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    if HAS_SKIP:  # a bad step: no element is in range, nothing is stored
        n = tl.where(tl.load(skip_ptr) == 0, n, 0)
    mask = offs < n
    step = tl.load(step_ptr)  # this step's count (incremented before the launch)
    bias1 = 1.0 - tl.exp2(step * log2_beta1)
    bias2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
    p = tl.load(param_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    m = tl.load(exp_avg_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(exp_avg_sq_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g / tl.load(scale_ptr)
    p = p - lr * weight_decay * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.sqrt(v) / bias2_sqrt + eps
    p = p - (lr / bias1) * m / denom
    tl.store(param_ptr + offs, p.to(param_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_ptr + offs, m.to(exp_avg_ptr.dtype.element_ty), mask=mask)
    tl.store(exp_avg_sq_ptr + offs, v.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)


class FusedAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update in one Triton launch a parameter. `decoupled_grad`: the
    gradients are in `param.decoupled_grad` (engine.use_decoupled_grad), any float dtype."""

    reads_scaler_values = True  # found_inf and grad_scale, as torch's fused AdamW (optim.skips_on_device)

    def __init__(self, groups, *, lr: float, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
                 decoupled_grad: bool = False):
        super().__init__(groups, torch_adamw_defaults(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.decoupled_grad = decoupled_grad
        self.grad_scale: Optional[torch.Tensor] = None  # set by components/optim.arm_device_step
        self.found_inf: Optional[torch.Tensor] = None

    def _grad(self, p: torch.Tensor) -> Optional[torch.Tensor]:
        # (Megatron-FSDP's set-up step fills param.grad even under decoupled gradients)
        g = getattr(p, "decoupled_grad", None) if self.decoupled_grad else None
        return g if g is not None else p.grad

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        work = []
        for group in self.param_groups:
            for p in group["params"]:
                g = self._grad(p)
                if g is None or local(p).numel() == 0:
                    continue
                s = self.state[p]
                device = local(p).device
                if not s:
                    s["step"] = torch.zeros((), dtype=torch.float32, device=device)
                    s["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    s["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif s["step"].device != device or s["step"].dtype != torch.float32:  # (a checkpoint's)
                    s["step"] = s["step"].to(device=device, dtype=torch.float32)
                work.append((group, p, g, s))
        if not work:
            return loss
        skip, scale = self.found_inf, self.grad_scale
        steps: List[torch.Tensor] = [s["step"] for _, _, _, s in work]
        # A skipped step does not count (torch's fused AdamW subtracts found_inf afterwards).
        torch._foreach_add_(steps, 1.0 if skip is None else (1.0 - skip).to(steps[0].dtype))
        for group, p, g, s in work:
            self._launch(group, local(p), local(g), local(s["exp_avg"]), local(s["exp_avg_sq"]), s["step"],
                         scale, skip)
        return loss

    @staticmethod
    def _launch(group, p, g, m, v, step, scale, skip) -> None:
        for t, name in ((p, "parameter"), (g, "gradient"), (m, "exp_avg"), (v, "exp_avg_sq")):
            if not t.is_contiguous():
                raise ValueError(f"optim.impl=triton: a non-contiguous {name} of shape {tuple(t.shape)}")
        beta1, beta2 = group["betas"]
        n = p.numel()
        _adamw_kernel[(triton.cdiv(n, BLOCK),)](
            p, g, m, v, step, scale if scale is not None else step, skip if skip is not None else step, n,
            float(group["lr"]), beta1, beta2, math.log2(beta1), math.log2(beta2), group["eps"],
            group["weight_decay"], HAS_SCALE=scale is not None, HAS_SKIP=skip is not None, BLOCK=BLOCK)
