"""model=hf with data.pack=documents data.doc_mask=true (models/doc_attention.py): a tiny HF Llama's
packed documents give each document's logits as if it were alone (positions restart), no gradient
crosses a boundary, and it trains through the worker's wiring on a loss-masked packed corpus (on
the CPU through the dense fallback; tests/gpu/test_sft_gpu.py checks the varlen path)."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import EOS, one_rank_group, read_metrics, train_wired, write_masked_corpus

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)
LENGTHS = (5, 7, 4)  # three documents packed in one row


def test_documents_are_isolated_in_an_hf_llama():
    from mfsdp_launch.models.doc_attention import ATTENTION, KERNELS, hf_document_logits

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(transformers.LlamaConfig(**TINY), attn_implementation="sdpa")
    ids = torch.randint(1, 256, (1, sum(LENGTHS)))
    doc_ids = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS)).unsqueeze(0)
    dense = KERNELS["dense"]
    captured = {}
    hook = model.model.embed_tokens.register_forward_hook(lambda m, a, out: captured.update(emb=out) or out.retain_grad())
    logits = hf_document_logits(model, ids, doc_ids)
    hook.remove()
    assert model.config._attn_implementation == ATTENTION and KERNELS["dense"] == dense + TINY["num_hidden_layers"]
    start = 0
    with torch.no_grad():
        for n in LENGTHS:  # each document alone, from position 0: the same logits
            alone = model(input_ids=ids[:, start:start + n]).logits
            assert torch.allclose(logits[:, start:start + n], alone, atol=1e-5)
            start += n
    second = LENGTHS[0] + 3  # a token of the second document: its inputs are that document's only
    logits[0, second].sum().backward()
    touched = captured["emb"].grad[0].abs().sum(-1) > 0
    assert touched[LENGTHS[0]:second + 1].all() and not touched[:LENGTHS[0]].any() and not touched[second + 1:].any()


def test_hf_llama_trains_on_packed_masked_documents(tmp_path):
    from mfsdp_launch.models.doc_attention import ATTENTION, KERNELS

    rng = np.random.default_rng(0)
    docs, masks = [], []
    for _ in range(60):
        prompt, answer = int(rng.integers(3, 12)), int(rng.integers(1, 10))
        docs.append(np.append(rng.integers(1, 64, size=prompt + answer), EOS))
        masks.append(np.r_[np.zeros(prompt, np.uint8), np.ones(answer + 1, np.uint8)])
    corpus = write_masked_corpus(tmp_path / "chat", docs, masks)
    fields = ", ".join(f"{k}: {v}" for k, v in TINY.items())
    run = tmp_path / "run"
    overrides = ["model=hf", "model.hf_class=LlamaForCausalLM", f"model.hf_config={{{fields}}}", "engine=fsdp2",
                 "precision.compute_dtype=fp32", "precision.main_params_dtype=fp32", "data=tokens",
                 f"data.sources=[{{path: '{corpus}'}}]", "data.pack=documents", "data.doc_mask=true",
                 "train.seq_len=48", "train.steps=4", "train.micro_batch_size=2", "train.grad_accum_steps=1",
                 "train.log_interval=1", "train.progress=false", "optim.lr=1e-2", "optim.warmup_steps=0",
                 "launcher.nproc_per_node=1", f"run.dir={run}", "checkpoint.save_final=false",
                 "checkpoint.interval_minutes=null"]
    dense = KERNELS["dense"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with one_rank_group(tmp_path / "store"):
            _, tr = train_wired(0, 1, overrides)
    finally:
        torch.set_num_threads(threads)
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and rows[-1]["loss"] < rows[0]["loss"]
    assert all(0 < r["target_tokens_per_step"] < 2 * 48 for r in rows)  # the loss mask held
    assert tr.model.config._attn_implementation == ATTENTION
    assert KERNELS["dense"] - dense == 4 * TINY["num_hidden_layers"]  # one per layer and forward: the CPU path
