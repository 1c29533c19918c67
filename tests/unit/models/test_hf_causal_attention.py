"""model=hf's causal attention (models/hf/causal_attention.py): the family's build makes no
device-to-host sync in a training forward and backward (transformers' SDPA mask preparation
makes one per forward), with the losses and gradients of transformers' SDPA to the bit; an
architecture with a sliding window keeps transformers' SDPA."""

from __future__ import annotations

from collections import Counter

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from helpers import model_cfg  # noqa: E402
from mfsdp_launch.models import build_model_spec  # noqa: E402
from mfsdp_launch.models.hf.causal_attention import ATTENTION  # noqa: E402

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128}


class HostReads(TorchDispatchMode):
    """Counts the ops that copy a device value to the host (`.item()`, `bool(tensor)`): on a GPU,
    each waits for everything queued before it."""

    def __init__(self):
        super().__init__()
        self.count = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten._local_scalar_dense, torch.ops.aten.is_nonzero):
            self.count[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _step(spec, model):
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    model.zero_grad()
    with HostReads() as reads:
        loss = spec.loss(model, {"input_ids": ids, "labels": ids})
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(reads.count.values())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_family_build_syncs_nowhere_and_trains_as_transformers_sdpa(arch):
    spec = build_model_spec(model_cfg("hf", hf_config={"model_type": arch, **TINY}), 32)
    torch.manual_seed(0)
    model = spec.build()
    assert model.config._attn_implementation == ATTENTION
    loss, grads, reads = _step(spec, model)
    model.set_attn_implementation("sdpa")  # transformers' own path, same weights
    sdpa_loss, sdpa_grads, sdpa_reads = _step(spec, model)
    assert (reads, sdpa_reads) == (0, 1)  # transformers' packed-sequence check: one sync a forward
    assert torch.equal(loss, sdpa_loss)
    assert all(torch.equal(grads[n], sdpa_grads[n]) for n in grads)


@pytest.mark.parametrize("fields", [
    {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},
    {"model_type": "mistral", "sliding_window": 8},
    {"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
], ids=["qwen2_window", "mistral_window", "qwen3_window"])
def test_a_model_with_more_than_a_causal_mask_keeps_transformers_sdpa(fields):
    spec = build_model_spec(model_cfg("hf", hf_config={**TINY, "head_dim": 16, **fields}), 32)
    assert spec.build().config._attn_implementation == "sdpa"
