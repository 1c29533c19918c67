"""data.doc_mask on model=gpt: a packed sample's documents do not see each other, so the GPT's
logits and loss on a packed row equal those of each document run alone."""

from __future__ import annotations

import pytest
import torch

from mfsdp_launch.models.llama.config import GPTModelConfig
from mfsdp_launch.corpus import block_causal_mask, doc_ids_from_eos
from mfsdp_launch.models.doc_attention import Documents
from mfsdp_launch.models.losses import lm_loss
from mfsdp_launch.models.llama.gpt_modules import GPT
from mfsdp_launch.models.llama.dims import resolve_gpt_dims

EOS = 0
LENGTHS = [[9, 14, 5, 12], [25, 15]]  # two rows of 40 tokens


def packed_rows(seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = [torch.cat([torch.cat([torch.randint(1, 256, (n - 1,), generator=g), torch.tensor([EOS])])
                       for n in lens]) for lens in LENGTHS]
    return torch.stack(rows)


def tiny_gpt(n_kv_heads=None):
    torch.manual_seed(0)
    model = GPT(resolve_gpt_dims(GPTModelConfig(preset="tiny", n_heads=4, n_kv_heads=n_kv_heads)))
    return model.eval()


def test_mask_blocks_attention_across_eos():
    toks = torch.tensor([[5, 6, EOS, 7, EOS, 8, 9, 10]])
    mask = block_causal_mask(doc_ids_from_eos(toks, EOS))[0, 0]
    allowed = {(q, k) for q in range(8) for k in range(8) if mask[q, k]}
    docs = [range(0, 3), range(3, 5), range(5, 8)]
    expected = {(q, k) for d in docs for q in d for k in d if k <= q}
    assert allowed == expected


@pytest.mark.parametrize("n_kv_heads", [None, 2])  # plain and grouped-query attention
def test_packed_documents_equal_documents_alone(n_kv_heads):
    model = tiny_gpt(n_kv_heads)
    seq = packed_rows()
    inputs, labels = seq[:, :-1], seq[:, 1:]
    doc_ids = doc_ids_from_eos(inputs, EOS)
    with torch.no_grad():
        masked = model(inputs, doc_ids=doc_ids)
        plain = model(inputs)
        alone = torch.zeros_like(masked)
        for b in range(inputs.shape[0]):
            for d in doc_ids[b].unique():
                pos = (doc_ids[b] == d).nonzero().flatten()
                alone[b, pos] = model(inputs[b : b + 1, pos])[0]
    torch.testing.assert_close(masked, alone, rtol=1e-5, atol=1e-5)
    later = doc_ids > 0
    assert not torch.allclose(plain[later], alone[later], atol=1e-3)  # without the mask they differ
    # the loss the loop computes from a batch dict with doc_ids is the loss of the separate documents
    batch = {"input_ids": inputs, "labels": labels, "doc_ids": doc_ids}
    with torch.no_grad():
        loss = lm_loss(model, batch)
        separate = torch.nn.functional.cross_entropy(alone.flatten(0, 1), labels.flatten())
        unmasked = lm_loss(model, {"input_ids": inputs, "labels": labels})
    torch.testing.assert_close(loss, separate, rtol=1e-5, atol=1e-6)
    assert abs(loss.item() - unmasked.item()) > 1e-4


def test_doc_mask_gradients_stay_inside_documents():
    model = tiny_gpt()
    seq = packed_rows(1)[:1]
    inputs = seq[:, :-1]
    doc_ids = doc_ids_from_eos(inputs, EOS)
    emb = model.tok_emb(inputs).detach().requires_grad_(True)
    x = emb
    mask = Documents(doc_ids)  # what GPT.forward hands every layer
    for layer in model.layers:
        x = layer(x, mask)
    x[0, LENGTHS[0][0] + 3].sum().backward()  # a token of the second document
    touched = emb.grad[0].abs().sum(-1) > 0
    assert touched[LENGTHS[0][0] : LENGTHS[0][0] + 4].all()
    assert not touched[: LENGTHS[0][0]].any() and not touched[LENGTHS[0][0] + 4 :].any()
