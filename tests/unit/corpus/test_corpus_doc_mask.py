"""Document masking: attention inside a packed sample never crosses an EOS boundary."""

from __future__ import annotations

import numpy as np
import pytest

from mfsdp_launch.corpus.doc_mask import (block_causal_mask, cu_seqlens, doc_ids_from_boundaries, doc_ids_from_eos, flex_block_mask, position_ids)

torch = pytest.importorskip("torch")
F = torch.nn.functional
EOS = 0


def packed_row(lengths, seed):
    """Tokens of documents of ``lengths`` (each ending with EOS), concatenated."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.cat([torch.randint(1, 50, (n - 1,), generator=g), torch.tensor([EOS])]) for n in lengths]
    return torch.cat(docs)


def test_mask_is_block_causal():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 0]])
    m = block_causal_mask(ids)
    assert m.shape == (2, 1, 6, 6) and m.dtype == torch.bool
    row0 = m[0, 0]
    assert row0[4].tolist() == [False, False, False, True, True, False]
    assert row0[5].tolist() == [False] * 5 + [True]
    assert torch.equal(m[1, 0], torch.ones(6, 6, dtype=torch.bool).tril())  # one document: plain causal


def test_doc_ids_from_eos_and_boundaries_agree():
    toks = packed_row([3, 5, 2, 4], seed=0)
    ids = doc_ids_from_eos(toks, EOS)
    assert ids.tolist() == [0] * 3 + [1] * 5 + [2] * 2 + [3] * 4
    assert np.array_equal(doc_ids_from_eos(toks.numpy(), EOS), ids.numpy())
    assert np.array_equal(doc_ids_from_boundaries(14, [3, 8, 10]), ids.numpy())
    assert position_ids(ids).tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3]]


def test_cu_seqlens_splits_rows_and_documents():
    ids = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 0, 0, 1]])
    assert cu_seqlens(ids).tolist() == [0, 2, 5, 9, 10]
    assert cu_seqlens(ids).dtype == torch.int32


def test_sdpa_with_mask_equals_each_document_alone():
    torch.manual_seed(0)
    lengths = [[7, 12, 5, 8], [20, 12]]
    toks = torch.stack([packed_row(ls, seed=i) for i, ls in enumerate(lengths)])  # [2, 32]
    ids = doc_ids_from_eos(toks, EOS)
    b, h, t, d = 2, 3, toks.shape[1], 8
    emb = torch.randn(50, h * d)
    x = emb[toks].view(b, t, h, d).transpose(1, 2)  # q = k = v from the tokens: content matters
    q, k, v = x * 0.7, x * 1.3, x
    masked = F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(ids))
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for row, ls in enumerate(lengths):
        start = 0
        for n in ls:
            sl = slice(start, start + n)
            alone = F.scaled_dot_product_attention(q[row:row + 1, :, sl], k[row:row + 1, :, sl],
                                                   v[row:row + 1, :, sl], is_causal=True)
            torch.testing.assert_close(masked[row:row + 1, :, sl], alone, rtol=1e-5, atol=1e-6)
            if start:  # the control: without the mask, later documents see earlier ones
                assert not torch.allclose(plain[row:row + 1, :, sl], alone, atol=1e-4)
            start += n


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on CPU is the point
def test_flex_block_mask_matches_the_sdpa_mask():
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    ids = torch.tensor([[0] * 40 + [1] * 50 + [2] * 38, [0] * 100 + [1] * 28])
    q, k, v = torch.randn(3, 2, 2, 128, 16).unbind(0)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=block_causal_mask(ids))
    got = flex.flex_attention(q, k, v, block_mask=flex_block_mask(ids))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
