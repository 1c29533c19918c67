"""data.doc_mask on model=te_gpt (models/llama/te_modules.py): what runs without Transformer Engine.

* `thd_arguments`: the keywords TE's TransformerLayer gets for a [B, T] batch flattened to B * T
  tokens: cu_seqlens cut at every document and row end, max_seqlen T, "padding_causal".
* RoPE scores depend only on the distance between two tokens: TE's THD RoPE restarts positions in
  every document, gpt's does not, and both give the same attention.
* The layer's per-call THD switch and TEGPT's flattening, on a stand-in for TE that follows TE's
  documented contract (the real kernels run in tests/gpu/test_one_gpu_te.py).
* Validation: te_gpt with data.doc_mask is accepted; with mesh.tp > 1 or fp8.attention it is one line.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn as nn

from helpers import EOS, refused, write_corpus
from mfsdp_launch.corpus import cu_seqlens
from mfsdp_launch.models.doc_attention import KERNELS
from mfsdp_launch.models.llama import te_modules
from mfsdp_launch.models.llama.dims import GPTDims
from mfsdp_launch.models.llama.gpt_modules import apply_rope, rope_cos_sin
from mfsdp_launch.planner import prepare

# ---------------------------------------------------------------------------- cu_seqlens for TE


def test_thd_arguments_cut_every_document_and_row_end():
    # Row 1 starts inside the document row 0 ends with (same id): the row end still cuts.
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [2, 2, 2, 2, 3, 3, 3, 3]])
    thd = te_modules.thd_arguments(doc_ids)
    cu = thd["cu_seqlens_q"]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 8, 12, 16]
    assert thd["cu_seqlens_kv"] is cu and torch.equal(cu, cu_seqlens(doc_ids))
    assert thd["max_seqlen_q"] == thd["max_seqlen_kv"] == 8  # T bounds every document, no device sync
    assert thd["self_attn_mask_type"] == "padding_causal"  # TE's THD attention takes padding types only
    lengths = cu.diff()
    assert int(lengths.sum()) == doc_ids.numel() and int(lengths.max()) <= thd["max_seqlen_q"]


def test_thd_arguments_take_the_loaders_cu_seqlens():
    doc_ids = torch.tensor([[0, 0, 1, 1]])
    loader = torch.tensor([0, 2, 4], dtype=torch.int64)  # the host's, any integer dtype
    thd = te_modules.thd_arguments(doc_ids, loader, torch.device("cpu"))
    assert thd["cu_seqlens_q"].dtype == torch.int32 and thd["cu_seqlens_q"].tolist() == [0, 2, 4]
    marked = torch.tensor([0, 1, 4], dtype=torch.int32)  # not what doc_ids say: the loader's is used as given
    assert te_modules.thd_arguments(doc_ids, marked)["cu_seqlens_q"].tolist() == [0, 1, 4]


def test_rope_scores_depend_only_on_the_distance():
    """Why TE's per-document positions (0 at every document start) and gpt's row positions agree."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 2, 11, 16, generator=g)
    scores = []
    for start in (0, 37):
        cos, sin = rope_cos_sin(torch.arange(start, start + 11), 16, 10000.0, "cpu")
        scores.append(apply_rope(q, cos, sin) @ apply_rope(k, cos, sin).transpose(-1, -2))
    torch.testing.assert_close(scores[0], scores[1], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------- a stand-in for TE


class FakeAttention(nn.Module):
    def __init__(self, qkv_format: str):
        super().__init__()
        self.qkv_format = qkv_format


def _running_mean(x: torch.Tensor) -> torch.Tensor:
    """Causal mixing of x [n, h]: token i gets the mean of tokens 0..i (attention with equal scores)."""
    return x.cumsum(0) / torch.arange(1, x.shape[0] + 1, dtype=x.dtype).unsqueeze(-1)


class FakeTransformerLayer(nn.Module):
    """TE's TransformerLayer contract, as far as TEGPT uses it: the layout comes from
    `self_attention.qkv_format`; "thd" takes [t, h] with cu_seqlens, a padding mask type and a RoPE
    table of at least the longest sequence; "bshd" takes [b, s, h], causal over each row."""

    def __init__(self, *, hidden_size: int, attn_input_format: str, **_):
        super().__init__()
        self.attn_input_format, self.sequence_parallel = attn_input_format, False
        self.self_attention = FakeAttention(attn_input_format)
        self.proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.calls = []

    def forward(self, x, rotary_pos_emb=None, self_attn_mask_type=None, cu_seqlens_q=None, cu_seqlens_kv=None,
                max_seqlen_q=None, max_seqlen_kv=None):
        fmt = self.self_attention.qkv_format
        self.calls.append((fmt, tuple(x.shape), rotary_pos_emb.shape[0]))
        if fmt == "thd":
            assert x.dim() == 2 and "padding" in self_attn_mask_type and cu_seqlens_q.dtype == torch.int32
            lengths = cu_seqlens_q.diff()
            assert cu_seqlens_kv is cu_seqlens_q and int(lengths.max()) <= rotary_pos_emb.shape[0]
            mixed = torch.cat([_running_mean(p) for p in torch.split(x, lengths.tolist())])
        else:
            assert x.dim() == 3 and cu_seqlens_q is None and rotary_pos_emb.shape[0] == x.shape[1]
            mixed = torch.stack([_running_mean(row) for row in x])
        return x + self.proj(mixed)


class FakeRope:
    def __init__(self, dim: int, rotary_base: float):
        self.dim = dim

    def __call__(self, n: int) -> torch.Tensor:
        return torch.zeros(n, 1, 1, self.dim)


@pytest.fixture
def fake_te(monkeypatch):
    fake = types.SimpleNamespace(TransformerLayer=FakeTransformerLayer, RotaryPositionEmbedding=FakeRope,
                                 QuantizedTensor=type("QuantizedTensor", (), {}))
    monkeypatch.setattr(te_modules, "te_module", lambda *a: fake)
    monkeypatch.setattr(te_modules, "te_device", lambda: "cpu")
    te_modules.rope_transformer_layer_class.cache_clear()  # the class is built on (and cached for) this fake
    yield fake
    te_modules.rope_transformer_layer_class.cache_clear()


def _layer():
    return te_modules.rope_transformer_layer_class()(hidden_size=8, attn_input_format="bshd", rope_dim=4,
                                                    rope_theta=10000.0)


def test_layer_runs_thd_for_one_call_only(fake_te):
    layer = _layer()
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    before = KERNELS["te_thd"]
    layer(torch.randn(12, 8), **te_modules.thd_arguments(doc_ids))
    assert layer.calls[-1] == ("thd", (12, 8), 6) and KERNELS["te_thd"] == before + 1  # table: max_seqlen rows
    assert layer.self_attention.qkv_format == "bshd"  # back to the built layout
    layer(torch.randn(2, 6, 8))
    assert layer.calls[-1] == ("bshd", (2, 6, 8), 6) and KERNELS["te_thd"] == before + 1
    with pytest.raises(AssertionError):  # a failing THD call (a 3-D input) leaves the built layout too
        layer(torch.randn(2, 6, 8), **te_modules.thd_arguments(doc_ids))
    assert layer.self_attention.qkv_format == "bshd"


def test_te_gpt_packed_rows_equal_documents_alone(fake_te):
    torch.manual_seed(0)
    dims = GPTDims(dim=8, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=16, vocab_size=32, tie_embeddings=True,
                   norm_eps=1e-5, rope_theta=10000.0)
    model = te_modules.TEGPT(dims)
    lengths = [[3, 5, 2], [6, 4]]
    ids = torch.randint(0, 32, (2, 10))
    doc_ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths])
    before = KERNELS["te_thd"]
    with torch.no_grad():
        packed = model(ids, doc_ids=doc_ids)
        assert KERNELS["te_thd"] == before + dims.n_layers
        assert [layer.calls[-1][:2] for layer in model.layers] == [("thd", (20, 8))] * dims.n_layers
        assert torch.equal(model(ids, doc_ids=doc_ids, cu_seqlens=cu_seqlens(doc_ids)), packed)  # the loader's
        plain = model(ids)
        for b, row in enumerate(lengths):
            start = 0
            for n in row:
                alone = model(ids[b:b + 1, start:start + n])[0]
                torch.testing.assert_close(packed[b, start:start + n], alone, rtol=1e-5, atol=1e-6)
                if start:  # without doc_ids, later documents see the earlier ones
                    assert not torch.allclose(plain[b, start:start + n], alone, atol=1e-4)
                start += n
    assert packed.shape == (2, 10, 32) and all(layer.self_attention.qkv_format == "bshd" for layer in model.layers)


# ---------------------------------------------------------------------------- validation

TE_GPT = ["model=te_gpt", "model.preset=tiny", "launcher.dry_run=true", "train.seq_len=64"]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """data=tokens over a small corpus, packed by document, with document masks."""
    import numpy as np

    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(1, 256, size=int(rng.integers(5, 60))), EOS) for _ in range(200)]
    corpus = write_corpus(tmp_path_factory.mktemp("docs") / "c", docs)
    return ["data=tokens", f"data.sources=[{{path: '{corpus}'}}]", "data.pack=documents", "data.doc_mask=true",
            f"data.cache_dir={tmp_path_factory.mktemp('cache')}"]


@pytest.mark.parametrize("extra", [["engine=megatron_fsdp"],
                                   ["engine=megatron_fsdp", "model.activation_checkpointing=full"],
                                   ["engine=megatron_fsdp", "fp8.recipe=delayed"],  # FP8 GEMMs, bf16 attention
                                   ["engine=fsdp2"]])
def test_te_gpt_doc_mask_is_accepted(packed, extra):
    cfg, _ = prepare([*TE_GPT, *packed, *extra], check_hardware=False)
    assert cfg.data.doc_mask is True and str(cfg.model.name) == "te_gpt"


@pytest.mark.parametrize("extra,key,words", [
    (["engine=megatron_fsdp", "mesh.tp=2", "launcher.nproc_per_node=2"], "data.doc_mask", "mesh.tp=2"),
    (["engine=megatron_fsdp", "mesh.cp=2", "launcher.nproc_per_node=2"], "data.doc_mask", "mesh.cp=2"),
    (["engine=megatron_fsdp", "fp8.recipe=delayed", "fp8.attention=true"], "fp8.attention", "THD"),
])
def test_te_gpt_doc_mask_refusals(packed, extra, key, words):
    err = refused(*TE_GPT, *packed, *extra)
    assert err.key == key and words in str(err) and "\n" not in str(err), str(err)
