"""One GPU: the eager step's RoPE kernel (models/llama/rope_kernel.py) against the plain torch
math it replaces, in bf16: forward and backward within one unit in the last place, almost all
elements bitwise; and an eager gpt's loss and gradients with the kernel equal those without it
(the kernel did run: its launches are counted). With TE: te_gpt's RoPE table is TE's own without
scaling and gpt's Llama-3-scaled angles with it, and a scaled te_gpt gives transformers' logits."""

from __future__ import annotations

import pytest

from _harness import require_gpus, require_te

pytestmark = pytest.mark.gpu


def test_the_kernel_equals_the_plain_math_in_bf16():
    require_gpus(1)
    import torch

    from mfsdp_launch.models.llama import rope_kernel
    from mfsdp_launch.models.llama.gpt_modules import plain_rope, rope_cos_sin

    torch.manual_seed(0)
    B, T, H, hd = 4, 2048, 16, 128
    cos, sin = rope_cos_sin(T, hd, 10000.0, "cuda")
    base = torch.randn(B, T, H, hd, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(B, H, T, hd, device="cuda", dtype=torch.bfloat16)
    x = base.transpose(1, 2).requires_grad_(True)
    y = rope_kernel.fused_rope(x, cos, sin)
    y.backward(g)
    xr = base.transpose(1, 2).requires_grad_(True)
    yr = plain_rope(xr, cos, sin)
    yr.backward(g)
    for name, a, b in (("forward", y, yr), ("backward", x.grad, xr.grad)):
        rel = ((a.float() - b.float()).abs() / b.float().abs().clamp(min=1e-2)).max().item()
        differ = (a != b).float().mean().item()
        print(f"rope {name}: max rel diff {rel:.2e}, elements that differ {100 * differ:.3f} %")
        assert rel <= 2 ** -7 and differ < 0.01
    assert y.stride() == x.stride()


def test_an_eager_gpt_trains_alike_with_the_kernel(monkeypatch):
    require_gpus(1)
    import torch

    from mfsdp_launch.models.llama import rope_kernel
    from mfsdp_launch.models.llama.dims import GPTDims
    from mfsdp_launch.models.llama.gpt_modules import GPT

    dims = GPTDims(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=688, vocab_size=1000,
                   tie_embeddings=False, norm_eps=1e-5, rope_theta=1e4)
    ids = torch.randint(0, 1000, (2, 256), device="cuda")

    def loss_and_grads():
        torch.manual_seed(0)
        model = GPT(dims, dtype=torch.bfloat16).cuda()
        loss = torch.nn.functional.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())
        loss.backward()
        return loss.item(), torch.cat([p.grad.float().flatten() for p in model.parameters()])

    launches = []
    rotate = rope_kernel.rotate
    monkeypatch.setattr(rope_kernel, "rotate", lambda *a: launches.append(1) or rotate(*a))
    fused_loss, fused_grads = loss_and_grads()
    assert len(launches) == 2 * 2 * dims.n_layers  # q and k of each layer, forward and backward
    monkeypatch.setattr(rope_kernel, "applies", lambda *a: False)
    plain_loss, plain_grads = loss_and_grads()
    rel = ((fused_grads - plain_grads).norm() / plain_grads.norm()).item()
    print(f"eager gpt: loss {fused_loss:.6f} with the kernel, {plain_loss:.6f} without; grads rel {rel:.2e}")
    assert abs(fused_loss - plain_loss) < 1e-3 and rel < 1e-2


# Llama-3.2's scaling with the old context cut to 64 tokens: 300 positions cover its three bands.
SCALING = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)


def test_te_gpt_rope_table_is_tes_without_scaling_and_ours_with_it():
    """te_gpt's RoPE table: TE's RotaryPositionEmbedding for plain RoPE; for Llama-3 scaling (which TE's
    module lacks) ScaledRotaryEmbedding, which gives TE's table when unscaled and gpt's angles when scaled."""
    require_gpus(1)
    require_te()
    import torch

    from mfsdp_launch.models.llama.dims import RopeScaling
    from mfsdp_launch.models.llama.gpt_modules import rope_cos_sin
    from mfsdp_launch.models.llama.te_modules import ScaledRotaryEmbedding, rotary_embedding, te_module

    te, scaling, dim, theta, S = te_module(), RopeScaling(**SCALING), 64, 500000.0, 300
    tes = rotary_embedding(dim, theta)
    assert isinstance(tes, te.RotaryPositionEmbedding)  # today's runs: TE's own module, unchanged
    want = tes(S)
    got = ScaledRotaryEmbedding(dim, theta, None, "cuda")(S)
    assert got.shape == want.shape == (S, 1, 1, dim) and got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ScaledRotaryEmbedding(dim, theta, None, "cuda")(S - 10, offset=10), want[10:],
                               rtol=1e-6, atol=1e-6)
    scaled = rotary_embedding(dim, theta, scaling, "cuda")
    assert isinstance(scaled, ScaledRotaryEmbedding)
    table = scaled(S).view(S, dim)
    cos, sin = rope_cos_sin(S, dim, theta, "cuda", scaling)
    torch.testing.assert_close(table.cos(), cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(table.sin(), sin, rtol=0, atol=1e-6)
    assert (table - want.view(S, dim)).abs().max().item() > 1.0  # the scaling changed the angles


def test_a_scaled_te_gpt_loads_a_llama3_dir_with_transformers_logits(tmp_path):
    """A Llama-3-scaled HF directory (saved by transformers) read as model.init_from reads it, loaded
    into te_gpt: transformers' fp32 logits past the old context (TE's rounding: test_hf_te_gpu.py's bound)."""
    require_gpus(1)
    require_te()
    pytest.importorskip("transformers")
    import torch
    import transformers

    from helpers import write_llama_dir
    from mfsdp_launch.models import hf_weights as load
    from mfsdp_launch.models.llama import hf_keys as llama_keys
    from mfsdp_launch.models.llama.dims import RopeScaling
    from mfsdp_launch.models.llama.hf_config import read_llama_dims
    from mfsdp_launch.models.llama.te_modules import TEGPT, ScaledRotaryEmbedding

    torch.backends.cuda.matmul.allow_tf32 = False
    hf_dir = write_llama_dir(tmp_path / "llama3", hidden_size=128, intermediate_size=256, num_attention_heads=8,
                             rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **SCALING},
                             max_position_embeddings=512)
    dims = read_llama_dims(hf_dir, key="model.init_from")
    assert dims.rope_scaling == RopeScaling(**SCALING)
    with torch.device("cuda"):
        model = TEGPT(dims, params_dtype=torch.float32).eval()
    report = load.load_into_model(model, hf_dir, sources=llama_keys.sources(dims, "te_gpt"))
    assert report.unused == []
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                       attn_implementation="sdpa").cuda().eval()
    ids = torch.randint(0, dims.vocab_size, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        diff = (model(ids) - hf(ids).logits).abs().max().item()
    assert all(isinstance(layer._rope["module"], ScaledRotaryEmbedding) for layer in model.layers)
    print(f"scaled te_gpt -> HF max abs logit diff {diff:.2e}")
    assert diff <= 2e-3, diff
