"""One GPU: the cross-entropy that train.compile compiles (models/losses.py) gives the eager
kernel's loss and logit gradients on bf16 logits of a 152k vocabulary, ignored labels included."""

from __future__ import annotations

import pytest

from _harness import require_gpus

pytestmark = pytest.mark.gpu


def test_the_compiled_cross_entropy_equals_the_eager_one(monkeypatch):
    require_gpus(1)
    import torch

    from mfsdp_launch.models import losses

    monkeypatch.setitem(losses._COMPILED_CE, "on", True)
    monkeypatch.setitem(losses._COMPILED_CE, "fn", None)
    torch.manual_seed(0)
    logits = (torch.randn(2, 512, 151936, device="cuda") * 2).bfloat16()
    labels = torch.randint(0, 151936, (2, 512), device="cuda")
    labels[:, :40] = losses.IGNORE_INDEX
    got_in, want_in = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    got = losses.summed_cross_entropy(got_in, labels)
    want = losses.plain_summed_cross_entropy(want_in, labels)
    got.backward()
    want.backward()
    assert losses._COMPILED_CE["fn"] is not None  # the compiled one ran
    grad_rel = ((got_in.grad.float() - want_in.grad.float()).norm() / want_in.grad.float().norm()).item()
    print(f"compiled CE {got.item():.4f}, eager {want.item():.4f}; logit grads rel {grad_rel:.2e}")
    assert abs(got.item() - want.item()) <= 1e-5 * abs(want.item()) and grad_rel < 1e-2
