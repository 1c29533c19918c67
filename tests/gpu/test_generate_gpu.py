"""One GPU: `mfsdp-generate --compile` decodes through one captured CUDA graph and gives the
tokens of the eager KV-cache decoder (fp32, greedy), prompt after prompt over the same cache."""

from __future__ import annotations

import pytest

from _harness import require_gpus

pytestmark = pytest.mark.gpu


def test_the_captured_decode_step_gives_the_eager_tokens():
    require_gpus(1)
    import torch

    from mfsdp_launch.models.llama.dims import GPTDims
    from mfsdp_launch.models.llama.gpt_modules import GPT
    from mfsdp_launch.tools.generate import compiled_decoder, generate_gpt

    torch.manual_seed(0)
    dims = GPTDims(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=512,
                   tie_embeddings=False, norm_eps=1e-5, rope_theta=1e4)
    model = GPT(dims).cuda().eval()
    prompts = [[1, 5, 9, 200, 7], [3, 3, 3]]
    new = 24
    step, cache = compiled_decoder(model, max(map(len, prompts)) + new)
    assert step.__name__ == "replay"  # the CUDA-graph path, not the bare compiled function
    with torch.inference_mode():
        for prompt in prompts:
            eager = generate_gpt(model, prompt, max_new_tokens=new, eos_id=None)
            graphed = generate_gpt(model, prompt, max_new_tokens=new, eos_id=None, step=step, cache=cache)
            assert graphed == eager, (prompt, graphed, eager)
