"""optim.impl=triton (components/fused_adamw.py), its kernel in Triton's interpreter on CPU tensors:
the update of torch.optim.AdamW over steps with weight decay and without, a clip divisor and a
skipped step; bf16 gradients in param.decoupled_grad read as they are (never written); state that
loads from and into torch's AdamW. And its refusals on a CPU run, before anything is spawned."""

from __future__ import annotations

import pytest

from helpers import interpreted, refused

SCRIPT = r'''
import copy
import json

import torch
from mfsdp_launch.components.fused_adamw import FusedAdamW
from mfsdp_launch.components.optim import arm_device_step, skips_on_device

torch.manual_seed(0)
shapes = [(37, 11), (300,), (5,)]
start = [torch.randn(s) for s in shapes]


def groups(params):
    return [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]


ref_p = [torch.nn.Parameter(t.clone()) for t in start]
ours_p = [torch.nn.Parameter(t.clone()) for t in start]
bf_p = [torch.nn.Parameter(t.clone()) for t in start]
bf_ref_p = [torch.nn.Parameter(t.clone()) for t in start]
kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
ref = torch.optim.AdamW(groups(ref_p), foreach=True, **kw)
ours = FusedAdamW(groups(ours_p), **kw)
bf = FusedAdamW(groups(bf_p), decoupled_grad=True, **kw)
bf_ref = torch.optim.AdamW(groups(bf_ref_p), foreach=True, **kw)
out = {"skips_on_device": skips_on_device(ours, torch.device("cpu")), "worst": 0.0, "worst_bf16": 0.0}
for step, (size, divisor, bad) in enumerate([(1.0, 2.0, 0), (30.0, 5.0, 0), (3.0, 1.0, 1), (0.5, 1.0, 0)]):
    grads = [size * torch.randn(s) for s in shapes]
    arm_device_step(ours, torch.tensor(float(bad)), torch.tensor(divisor))
    arm_device_step(bf, torch.tensor(float(bad)), torch.tensor(divisor))
    for p, g in zip(ours_p, grads):
        p.grad = g.clone()
    kept = [g.bfloat16() for g in grads]
    for p, g in zip(bf_p, kept):
        p.decoupled_grad = g
    before_bf16 = [g.clone() for g in kept]
    if not bad:  # the reference clips first and skips a bad step by not stepping
        for p, g in zip(ref_p, grads):
            p.grad = g / divisor
        ref.step()
        for p, g in zip(bf_ref_p, kept):
            p.grad = g.float() / divisor
        bf_ref.step()
    ours.step()
    bf.step()
    out["bf16_grads_untouched"] = all(torch.equal(a, b) for a, b in zip(before_bf16, kept))
    for a, b in zip(ours_p, ref_p):
        out["worst"] = max(out["worst"], ((a - b).abs().max() / b.abs().max()).item())
    for a, b in zip(bf_p, bf_ref_p):
        out["worst_bf16"] = max(out["worst_bf16"], ((a - b).abs().max() / b.abs().max()).item())
out["steps"] = [ours.state[p]["step"].item() for p in ours_p]
out["moved"] = max((a - b).abs().max().item() for a, b in zip(ours_p, start))
sd = ours.state_dict()
out["same_keys"] = (sorted(sd["state"][0]) == sorted(ref.state_dict()["state"][0])
                    and sorted(sd["param_groups"][0]) == sorted(ref.state_dict()["param_groups"][0]))
# torch's state continues under ours: one more step from the same point on both
again_p = [torch.nn.Parameter(p.detach().clone()) for p in ref_p]
again = FusedAdamW(groups(again_p), **kw)
again.load_state_dict(copy.deepcopy(ref.state_dict()))  # (torch's load shares tensors)
grads = [torch.randn(s) for s in shapes]
for p, q, g in zip(again_p, ref_p, grads):
    p.grad, q.grad = g.clone(), g.clone()
again.step()
ref.step()
out["resumed"] = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(again_p, ref_p))
print(json.dumps(out))
'''


def test_the_triton_adamw_steps_as_torch_adamw_with_clip_skip_and_bf16_gradients():
    out = interpreted(SCRIPT)
    print(out)
    assert out["skips_on_device"]
    assert out["worst"] < 2e-6 and out["worst_bf16"] < 2e-6, out
    assert out["steps"] == [3.0, 3.0, 3.0]  # the skipped step did not count
    assert out["moved"] > 1e-2  # (the updates were not all zero)
    assert out["bf16_grads_untouched"] and out["same_keys"] and out["resumed"] < 2e-6, out


@pytest.mark.parametrize("overrides,hardware,key,words", [
    (["+recipe=cpu_smoke", "optim.impl=triton"], True, "optim.impl", "Triton kernel on CUDA tensors; this machine has no CUDA GPU"),
    (["+recipe=cpu_smoke", "optim.impl=triton", "engine.backend=gloo"], False, "optim.impl",
     "Triton kernel on CUDA tensors; engine.backend=gloo runs on the CPU"),
    (["engine=megatron_fsdp", "engine.use_decoupled_grad=true", "optim.impl=fused"], False,
     "engine.use_decoupled_grad", "false, or optim.impl=te_fused|triton"),
])
def test_the_triton_adamw_is_refused_where_it_cannot_step(overrides, hardware, key, words):
    err = refused(*overrides, hardware=hardware)
    assert err.key == key and words in str(err), err
