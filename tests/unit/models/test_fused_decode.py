"""mfsdp-generate's fused decode step (models/llama/fused_decode.py): its Triton kernels, run by
Triton's interpreter on CPU tensors, decode the eager KV-cache decoder's greedy tokens and logits;
what they cannot serve is named, and `--decoder triton` there is refused in one line."""

from __future__ import annotations

import os
import textwrap

import pytest

from helpers import interpreted

torch = pytest.importorskip("torch")

# Dims that reach both K paths and every masked edge: dim a whole number of K blocks (unmasked
# loads), ffn a K block past its end, vocab rows past the last tile, GQA, and a cache of two
# attention tiles split in two slices.
_SCRIPT = textwrap.dedent("""
    import json, torch
    from mfsdp_launch.models.llama.dims import GPTDims
    from mfsdp_launch.models.llama.gpt_modules import GPT
    from mfsdp_launch.models.llama.fused_decode import FusedDecoder
    from mfsdp_launch.models.llama.kv_cache import KVCache, decode_step, prefill
    from mfsdp_launch.tools.generate import generate_gpt

    dims = GPTDims(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=300,
                   tie_embeddings=False, norm_eps=1e-5, rope_theta=1e4)
    out = {}
    for dtype in ("float32", "bfloat16", "float32_early2"):
        FusedDecoder.EARLY = 2 if dtype.endswith("early2") else 1  # two weight blocks requested before the wait
        dtype = dtype.split("_")[0]
        torch.manual_seed(0)
        model = GPT(dims, dtype=getattr(torch, dtype)).eval()
        prompt = [1, 5, 9, 200, 7, 3, 3, 90]
        eager_cache, fused_cache = KVCache.for_model(model, 1, 70), KVCache.for_model(model, 1, 70)
        with torch.no_grad():
            prefill(model, torch.tensor([prompt]), eager_cache)
            prefill(model, torch.tensor([prompt]), fused_cache)
            fused = FusedDecoder(model, fused_cache)
            diffs = []
            for pos in ((8, 63, 64, 69) if dtype == "float32" else (40,)):  # tile/slice edges of 70
                token = torch.tensor([[pos % 300]])
                a = decode_step(model, token, torch.tensor(pos), eager_cache).float()
                b = fused(model, token, torch.tensor(pos), fused_cache).float()
                diffs.append([(a - b).abs().max().item(), a.abs().max().item(),
                              max((x.float() - y.float()).abs().max().item()
                                  for x, y in zip(eager_cache.keys + eager_cache.values,
                                                  fused_cache.keys + fused_cache.values))])
            tokens = [generate_gpt(model, prompt, max_new_tokens=4, eos_id=None, cache=c, step=s)
                      for c, s in ((None, None), (fused_cache, fused))] if dtype == "float32" else []
        out[dtype + ("_early2" if FusedDecoder.EARLY == 2 else "")] = {"diffs": diffs, "tokens": tokens,
                                                                      "splits": fused.splits}
    print(json.dumps(out))
""")


def test_interpreted_kernels_decode_the_eager_tokens_and_logits():
    out = interpreted(_SCRIPT)
    for run in ("float32", "float32_early2"):
        assert out[run]["splits"] == 2  # the cache's two tiles each in a slice
        for logits, scale, cache in out[run]["diffs"]:
            assert logits <= 1e-5 * max(1.0, scale) and cache <= 1e-6, out[run]["diffs"]
        eager, fused = out[run]["tokens"]
        assert fused == eager and len(eager) == 4
    # bf16: the same roundings, summed in another order: a few units in the last place.
    for logits, scale, cache in out["bfloat16"]["diffs"]:
        assert logits <= 4 * 2 ** -8 * max(1.0, scale) and cache <= 2 ** -6, out["bfloat16"]["diffs"]


_TAIL = textwrap.dedent("""
    import json, torch
    from mfsdp_launch.models.llama.fused_decode import FusedDecoder

    out = []
    for vocab, maxima in ((300, [7, 250]), (40000, [35000, 39999]), (40000, [5, 35000]), (32768, [32767])):
        logits = torch.randn(1, 1, vocab).to(torch.bfloat16)
        logits[0, 0, maxima] = 30.0  # equal maxima, in one block or in two: torch.argmax takes the first
        token, count, pos = torch.zeros(1, 1, dtype=torch.long), torch.tensor([2]), torch.tensor(9)
        ids = torch.full((4,), -1, dtype=torch.long)
        FusedDecoder.greedy_next(None, logits, token, ids, count, pos)
        out.append([int(token), ids.tolist(), int(count), int(pos), int(logits.argmax())])
    print(json.dumps(out))
""")


def test_the_greedy_tail_kernel_takes_the_first_maximum_and_advances():
    for token, ids, count, pos, want in interpreted(_TAIL):
        assert token == want and ids == [-1, -1, want, -1] and count == 3 and pos == 10


def test_what_the_fused_step_cannot_decode_is_named_and_refused_in_one_line():
    from mfsdp_launch.core.errors import ConfigError
    from mfsdp_launch.models.llama.dims import GPTDims
    from mfsdp_launch.models.llama.moe_dims import MoEDims
    from mfsdp_launch.models.llama.fused_decode import unsupported
    from mfsdp_launch.models.llama.gpt_modules import GPT
    from mfsdp_launch.tools.generate import pick_decoder

    base = dict(dim=64, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=96, vocab_size=64, tie_embeddings=True,
                norm_eps=1e-5, rope_theta=1e4)
    model = GPT(GPTDims(**base))
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.importorskip("triton")
        assert unsupported(model) == "its Triton kernels need a GPU"
        assert pick_decoder("auto", model) == "eager" and pick_decoder("compile", model) == "compile"
        with pytest.raises(ConfigError) as refused:
            pick_decoder("triton", model)
        assert str(refused.value).startswith("--decoder: triton: its Triton kernels need a GPU")
    assert unsupported(model, batch=2) in ("its Triton kernels need a GPU", "it decodes one sequence, not 2")
    os.environ["TRITON_INTERPRET"], saved = "1", os.environ.get("TRITON_INTERPRET")
    try:  # past the device check, the model's own shape decides
        assert unsupported(model, batch=2) == "it decodes one sequence, not 2"
        assert unsupported(GPT(GPTDims(**base, qk_norm=True))) == "model.qk_norm has no fused kernel"
        moe = GPT(GPTDims(**base, moe=MoEDims(experts=2, top_k=1, shared_experts=0, ffn_dim=32, every=1,
                                              router="softmax", aux_loss_coef=0.0, z_loss_coef=0.0,
                                              bias_update_rate=0.0, capacity_factor=None)))
        assert unsupported(moe) == "mixture-of-experts layers have no fused kernel"
        assert unsupported(GPT(GPTDims(**{**base, "dim": 48, "n_heads": 2, "n_kv_heads": 2}))) == \
            "head_dim 24 is not a power of two >= 16"
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
