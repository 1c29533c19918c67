"""mfsdp-generate's greedy decoding (tools/generate.py GreedyLoop): the argmax fed back on the device
gives the tokens of a step-by-step greedy loop over the same KV cache, and stopping at EOS (looked
for every `check_every` tokens) keeps exactly the tokens up to and including the first EOS."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from mfsdp_launch.models.llama.dims import GPTDims  # noqa: E402
from mfsdp_launch.models.llama.gpt_modules import GPT  # noqa: E402
from mfsdp_launch.models.llama.kv_cache import KVCache, decode_step, prefill  # noqa: E402
from mfsdp_launch.tools.generate import GreedyLoop, generate_gpt  # noqa: E402

PROMPT = [1, 5, 9, 2, 7]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    dims = GPTDims(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, vocab_size=11, tie_embeddings=False,
                   norm_eps=1e-5, rope_theta=1e4)
    model = GPT(dims).eval()
    with torch.no_grad():  # larger weights: a greedy stream of many tokens, not one repeated
        for p in model.parameters():
            p.mul_(4)
    return model  # a vocab of 11: each id comes up first somewhere mid-stream


def _step_by_step(model, n: int):
    """Greedy tokens the plain way: argmax on the host's side of every decode step."""
    cache = KVCache.for_model(model, 1, len(PROMPT) + n)
    logits = prefill(model, torch.tensor([PROMPT]), cache)[:, -1]
    out = []
    for i in range(n):
        token = logits.argmax(-1)
        out.append(int(token))
        logits = decode_step(model, token.view(1, 1), torch.tensor(len(PROMPT) + i), cache)[:, -1]
    return out


def test_the_greedy_loop_gives_the_step_by_step_tokens(model):
    with torch.inference_mode():
        want = _step_by_step(model, 40)
        assert generate_gpt(model, PROMPT, max_new_tokens=40, eos_id=None) == want
        assert generate_gpt(model, PROMPT, max_new_tokens=1, eos_id=None) == want[:1]
        assert generate_gpt(model, PROMPT, max_new_tokens=0, eos_id=None) == []


def test_stopping_at_eos_keeps_the_tokens_up_to_the_first_one(model):
    with torch.inference_mode():
        want = _step_by_step(model, 60)
    firsts = {}
    for i, t in enumerate(want):
        firsts.setdefault(t, i)
    # EOS as the prefill's own token, inside the first check chunk and in later ones.
    cases = sorted(firsts.values())
    assert cases[0] == 0 and sum(0 < i < GreedyLoop.check_every for i in cases) >= 2 and cases[-1] > 32, cases
    with torch.inference_mode():
        for i in cases:
            got = generate_gpt(model, PROMPT, max_new_tokens=60, eos_id=want[i])
            assert got == want[:i + 1], (i, got, want)
        assert generate_gpt(model, PROMPT, max_new_tokens=60, eos_id=11) == want  # an EOS that never comes


def test_one_loop_serves_prompt_after_prompt_over_its_cache(model):
    def step(*args):  # a decode step carrying its loop, as graphed_decoder's replay does
        return decode_step(*args)

    with torch.inference_mode():
        cache = KVCache.for_model(model, 1, 64)
        step.greedy = loop = GreedyLoop(model, step, cache, 64)
        for n in (30, 12):
            got = generate_gpt(model, PROMPT, max_new_tokens=n, eos_id=None, cache=cache, step=step)
            assert got == _step_by_step(model, n)
        assert int(loop.count) == 11  # the second prompt ran through this loop
        with pytest.raises(ValueError, match="do not fit"):
            loop.run(torch.zeros(1, 11), torch.tensor(len(PROMPT)), 70, None)
