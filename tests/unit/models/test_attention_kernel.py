"""model.attention_kernel (gpt): every Attention gets SDPA's backends in priority order, a kernel
that cannot run the input falls through to the next (on the CPU: torch's own), and the key is
refused where it would do nothing. On a GPU: tests/gpu/test_attention_kernel_gpu.py."""

from __future__ import annotations

import pytest
import torch

from helpers import refused
from mfsdp_launch.models.llama.dims import GPTDims
from mfsdp_launch.models.llama.gpt_modules import GPT, SDPA_BACKENDS, Attention, use_attention_kernel

DIMS = GPTDims(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=97, tie_embeddings=False,
               norm_eps=1e-5, rope_theta=10000.0)


def test_cudnn_puts_cudnn_first_in_every_attention_and_falls_through_where_it_cannot_run():
    torch.manual_seed(0)
    auto = GPT(DIMS)
    auto.init_weights()
    tokens = torch.randint(0, 97, (2, 16))
    want = auto(tokens)
    cudnn = use_attention_kernel(auto, "cudnn")
    attentions = [m for m in cudnn.modules() if isinstance(m, Attention)]
    assert len(attentions) == 2 and all(a.sdpa_backends == SDPA_BACKENDS["cudnn"] for a in attentions)
    assert SDPA_BACKENDS["cudnn"][0] == torch.nn.attention.SDPBackend.CUDNN_ATTENTION
    # CPU tensors: cuDNN cannot take them, torch's CPU kernel does, to the same values.
    torch.testing.assert_close(cudnn(tokens), want, rtol=0, atol=0)
    assert all(a.sdpa_backends is None for a in use_attention_kernel(cudnn, "auto").modules()
               if isinstance(a, Attention))


@pytest.mark.parametrize("overrides,hardware,words", [
    (["+recipe=cpu_smoke", "model.attention_kernel=cudnn"], True,
     "cuDNN's attention on CUDA tensors; this machine has no CUDA GPU"),
    (["+recipe=cpu_smoke", "model.attention_kernel=cudnn", "engine.backend=gloo"], False,
     "cuDNN's attention on CUDA tensors; engine.backend=gloo runs on the CPU"),
    (["engine=megatron_fsdp", "model=te_gpt", "model.attention_kernel=cudnn"], False,
     "TE attention picks its backend itself"),
])
def test_the_cudnn_kernel_is_refused_where_it_would_do_nothing(overrides, hardware, words):
    err = refused(*overrides, hardware=hardware)
    assert err.key == "model.attention_kernel" and words in str(err), err


def test_a_compiled_block_takes_the_kernel_choice_without_a_graph_break():
    """train.compile compiles each Block with fullgraph semantics in mind: the sdpa_kernel context
    must trace (Dynamo's SDPAKernelVariable), not split the block."""
    torch.manual_seed(0)
    model = GPT(DIMS)
    model.init_weights()
    tokens = torch.randint(0, 97, (2, 16))
    want = model(tokens)
    use_attention_kernel(model, "cudnn")
    for layer in model.layers:
        layer.compile(fullgraph=True)  # raises on a graph break
    got = model(tokens)
    got.sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
