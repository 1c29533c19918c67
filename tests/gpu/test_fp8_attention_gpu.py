"""fp8.attention=true on a GPU: TE's FP8 dot-product attention really runs (the losses differ from
FP8 GEMMs with bf16 attention, so it did not fall back) and trains like it (the same loss curve
within a few percent); the delayed-scaling state survives te_state's round trip."""

from __future__ import annotations

import pytest

from _harness import gpu_count, require_te

pytestmark = pytest.mark.gpu

STEPS = 20


def _train(attention: bool):
    import torch

    from mfsdp_launch.core.schema import FP8Config
    from mfsdp_launch.models.losses import lm_loss
    from mfsdp_launch.models.llama.dims import GPTDims
    from mfsdp_launch.models.llama.te_modules import TEGPT
    from mfsdp_launch.components.precision import build_fp8_recipe, fp8_autocast

    torch.manual_seed(0)
    # head_dim 128 and grouped queries, as in the 8b
    dims = GPTDims(dim=1024, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=2048, vocab_size=1024,
                   tie_embeddings=False, norm_eps=1e-5, rope_theta=10000.0)
    model = TEGPT(dims, params_dtype=torch.bfloat16).cuda()
    model.init_weights()
    recipe = build_fp8_recipe(FP8Config(recipe="delayed", attention=attention))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 256, (4, 1025), device="cuda", generator=gen)  # a learnable subset
        with fp8_autocast(recipe):
            loss = lm_loss(model, {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]})
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return model, losses


def test_fp8_attention_runs_and_trains_like_bf16_attention():
    if gpu_count() < 1:
        pytest.skip("needs a CUDA GPU")
    require_te()
    from mfsdp_launch.engines.te_state import load_te_extra_state, te_extra_state

    plain, ref = _train(attention=False)
    model, got = _train(attention=True)
    print("bf16 attention:", [round(x, 4) for x in ref[::5]], "fp8 attention:", [round(x, 4) for x in got[::5]])
    assert got != ref  # FP8 attention changed the numbers: it ran
    assert got[-1] < 0.8 * got[0]  # it learns
    assert abs(got[-1] - ref[-1]) / ref[-1] < 0.05
    # (TE's attention modules keep delayed-scaling state with or without FP8 attention: 9 modules
    # with history in both, measured; the round trip is what must hold.)
    with_history = lambda m: sum(1 for v in te_extra_state(m).values() if v)  # noqa: E731
    print("TE modules with FP8 history:", with_history(plain), "->", with_history(model))
    assert with_history(model) >= with_history(plain) > 0
    assert load_te_extra_state(model, te_extra_state(model)) == with_history(model)
