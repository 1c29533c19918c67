"""One GPU: a `model=hf` Llama built by the family (models/hf/causal_attention.py) trains a step,
eager and compiled, with no device-to-host sync (CUDA's sync debug mode turns one into an
error); transformers' own SDPA path does sync (the check could fail), and both give the same loss."""

from __future__ import annotations

import pytest

from _harness import require_gpus

pytestmark = pytest.mark.gpu

TINY = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512}


def _step(spec, model, ids):
    loss = spec.loss(model, {"input_ids": ids, "labels": ids})
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_hf_training_step_makes_no_device_sync(compiled):
    require_gpus(1)
    import torch
    from helpers import model_cfg

    from mfsdp_launch.models import build_model_spec
    from mfsdp_launch.models.compile import compile_model

    spec = build_model_spec(model_cfg("hf", hf_config=TINY, params_dtype="bf16"), 256)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = spec.build()
    forward = compile_model(model, spec.unit_modules)[0] if compiled else model
    ids = torch.randint(0, 512, (2, 256), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    _step(spec, forward, ids)  # (compiles; warm-up allocations)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss = _step(spec, forward, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    model.set_attn_implementation("sdpa")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchroniz"):
            _step(spec, forward, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    model.zero_grad()
    sdpa = _step(spec, forward, ids)
    print(f"hf {'compiled' if compiled else 'eager'}: no sync; loss {loss.item():.6f}, transformers' sdpa {sdpa.item():.6f}")
    assert torch.equal(loss, sdpa)
