"""One GPU: mfsdp-generate's captured decode steps (`--decoder triton`, the fused kernels, and
`--decoder compile`, torch.compile) replay one CUDA graph and give the eager KV-cache decoder's
tokens (fp32, greedy: the graph with the argmax fed back, GreedyLoop), prompt after prompt over
the same cache, and stop at EOS where the eager tokens do; in bf16 the fused step's logits
stay within a few units in the last place of the eager step's."""

from __future__ import annotations

import pytest

from _harness import require_gpus

pytestmark = pytest.mark.gpu


def _model(dtype=None):
    import torch

    from mfsdp_launch.models.llama.dims import GPTDims
    from mfsdp_launch.models.llama.gpt_modules import GPT

    torch.manual_seed(0)
    dims = GPTDims(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=688, vocab_size=1000,
                   tie_embeddings=False, norm_eps=1e-5, rope_theta=1e4)
    return GPT(dims, dtype=dtype).cuda().eval()


@pytest.mark.parametrize("decoder", ["triton", "compile"])
def test_the_captured_decode_step_gives_the_eager_tokens(decoder):
    require_gpus(1)
    import torch

    from mfsdp_launch.tools.generate import generate_gpt, graphed_decoder, pick_decoder

    model = _model()
    assert pick_decoder("auto", model) == "triton"  # what a GPU user gets by default
    prompts = [[1, 5, 9, 200, 7], [3, 3, 3]]
    new = 80  # past one 64-position attention tile
    step, cache = graphed_decoder(model, max(map(len, prompts)) + new, decoder)
    assert step.__name__ == "replay"  # the CUDA-graph path, not the bare step
    if decoder == "triton":  # every shape's tile re-picked in the graph (wo, w_down, head, swiglu, qkv), and
        # a second process's choice read back from the cache dir: here the same choice
        assert len(step.step.tiles) == 5, step.step.tiles
        assert graphed_decoder(model, max(map(len, prompts)) + new, decoder)[0].step.tiles == step.step.tiles
    with torch.inference_mode():
        for prompt in prompts:
            eager = generate_gpt(model, prompt, max_new_tokens=new, eos_id=None)
            graphed = generate_gpt(model, prompt, max_new_tokens=new, eos_id=None, step=step, cache=cache)
            assert graphed == eager, (prompt, graphed, eager)
            eos = eager[37]  # stopping at EOS (checked every GreedyLoop.check_every replays) keeps up to the first
            stopped = generate_gpt(model, prompt, max_new_tokens=new, eos_id=eos, step=step, cache=cache)
            assert stopped == eager[:eager.index(eos) + 1], (prompt, stopped, eager)


def test_fused_bf16_logits_follow_the_eager_step():
    require_gpus(1)
    import torch

    from mfsdp_launch.models.llama.fused_decode import FusedDecoder
    from mfsdp_launch.models.llama.kv_cache import KVCache, decode_step, prefill

    model = _model(torch.bfloat16)
    prompt = torch.tensor([[1, 5, 9, 200, 7, 11, 13]], device="cuda")
    caches = [KVCache.for_model(model, 1, 300) for _ in range(2)]
    with torch.inference_mode():
        for c in caches:
            prefill(model, prompt, c)
        fused = FusedDecoder(model, caches[1])
        worst = 0.0
        for pos in range(7, 300, 37):
            token = torch.tensor([[pos % 1000]], device="cuda")
            a = decode_step(model, token, torch.tensor(pos, device="cuda"), caches[0]).float()
            b = fused(model, token, torch.tensor(pos, device="cuda"), caches[1]).float()
            worst = max(worst, ((a - b).abs().max() / a.abs().max()).item())
    print(f"fused bf16 decode: worst logit difference {worst:.2e} of the largest logit")
    assert worst < 2 ** -5
