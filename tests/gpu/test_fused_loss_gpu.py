"""model.loss_kernel=te_fused on a GPU: TE's fused cross-entropy gives the loss and the gradients of
F.cross_entropy on fp32 logits (models/family.py), on te_gpt's bf16 logits, with a 128k-class
vocabulary as the 8B's head has."""

from __future__ import annotations

import pytest

from _harness import gpu_count, require_te

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("vocab", [256, 128256])
def test_te_fused_loss_matches_torch_cross_entropy(vocab):
    if gpu_count() < 1:
        pytest.skip("needs a CUDA GPU")
    require_te()
    import torch

    from mfsdp_launch.models.losses import lm_loss, te_fused_lm_loss
    from mfsdp_launch.models.llama.dims import GPTDims
    from mfsdp_launch.models.llama.te_modules import TEGPT

    torch.manual_seed(0)
    dims = GPTDims(dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=192, vocab_size=vocab, tie_embeddings=False,
                   norm_eps=1e-5, rope_theta=10000.0)
    model = TEGPT(dims, params_dtype=torch.bfloat16).cuda()
    model.init_weights()
    tokens = torch.randint(0, vocab, (2, 129), device="cuda")
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}

    def loss_and_grads(fn):
        model.zero_grad(set_to_none=True)
        loss = fn(model, batch)
        loss.backward()
        return loss.detach().float(), {n: p.grad.float().clone() for n, p in model.named_parameters()}

    ref, ref_grads = loss_and_grads(lm_loss)
    got, got_grads = loss_and_grads(te_fused_lm_loss)
    print(f"vocab {vocab}: torch {ref.item():.6f} fused {got.item():.6f}")
    assert torch.allclose(got, ref, rtol=1e-3), (got, ref)
    worst = max(((g - ref_grads[n]).norm() / ref_grads[n].norm().clamp(min=1e-12)).item() for n, g in got_grads.items())
    print(f"vocab {vocab}: worst relative gradient difference {worst:.2e}")
    assert worst < 2e-2  # bf16 gradients either way; only the loss's arithmetic differs
