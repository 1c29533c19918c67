"""mfsdp-eval on a loss-masked token set (issue 25): the loss counts only the target tokens the mask
selects, each weighing the same across batches as the training loop weighs them (per token, not a
mean of batch means). In process: the tool's own dataset and evaluate() on a real tiny gpt, checked
against the cross-entropy computed straight from the model on the same samples."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import EOS, model_cfg, one_line, write_masked_corpus
from mfsdp_launch.core.errors import ConfigError
from mfsdp_launch.data.batches import masked_batch
from mfsdp_launch.models import family
from mfsdp_launch.rank.token_weights import target_count, weighted_mean
from mfsdp_launch.tools.evaluate import eval_dataset, evaluate
from mfsdp_launch.tools.plain_model import PlainModel

SEQ, SAMPLES, BATCH = 16, 7, 3  # the last batch holds one sample: ragged target counts per batch


def chat_corpus(path, rng, answer=True):
    """Conversations: a prompt (mask 0) then an answer (mask 1) of random lengths, each ending with EOS."""
    docs, masks = [], []
    for _ in range(24):
        prompt, reply = int(rng.integers(3, 14)), int(rng.integers(1, 10))
        docs.append(np.append(rng.integers(1, 256, prompt + reply - 1), EOS))
        masks.append(np.r_[np.zeros(prompt), np.full(reply, 1 if answer else 0)].astype(np.uint8))
    return write_masked_corpus(path, docs, masks)


def tiny_gpt():
    torch.manual_seed(0)
    m = model_cfg("gpt", preset="tiny")
    spec = family("gpt").spec(m, SEQ)
    model = spec.build().eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)  # peaked predictions: the loss differs a lot from token to token
    return PlainModel(model=model, family="gpt", source=None, spec=spec)


def direct_losses(pm, ds):
    """Per-token cross-entropy of each sample's predicted tokens, and whether each is a target."""
    ce, target = [], []
    with torch.no_grad():
        for g in range(SAMPLES):
            toks, mask = ds.sample_parts(g, docs=False, mask=True)
            w = torch.from_numpy(toks)[None]
            ce.append(F.cross_entropy(pm.model(w[:, :-1])[0].float(), w[0, 1:], reduction="none"))
            target.append(torch.from_numpy(mask[1:].astype(bool)))
    return torch.cat(ce).double(), torch.cat(target)


def test_eval_loss_counts_only_the_masked_in_tokens_per_token(tmp_path):
    rng = np.random.default_rng(0)
    ds = eval_dataset(chat_corpus(tmp_path / "chat", rng), {"data": {}}, seq_len=SEQ, seed=0, vocab_size=256)
    assert ds.has_loss_mask
    pm = tiny_gpt()
    got = evaluate(pm, ds, samples=SAMPLES, batch_size=BATCH, doc_mask=False)

    ce, target = direct_losses(pm, ds)
    per_token = (ce[target].sum() / target.sum()).item()
    assert got["tokens"] == int(target.sum()) < target.numel()
    assert got["loss"] == pytest.approx(per_token, rel=1e-6)
    unmasked = ce.mean().item()
    assert abs(unmasked - per_token) > 1e-3 * per_token  # without the mask: another number, far past 1e-6

    # Training's rule, on the batches it would read: per token across batches, not a mean of means.
    batches = [masked_batch(ds, s, min(BATCH, SAMPLES - s), False) for s in range(0, SAMPLES, BATCH)]
    counts = [target_count(b) for b in batches]
    with torch.no_grad():
        means = [pm.spec.loss(pm.model, b) for b in batches]
    assert len({int(c) for c in counts}) > 1  # ragged: the two ways of averaging differ
    assert weighted_mean(means, counts, world=1) == pytest.approx(got["loss"], rel=1e-5)
    assert abs(float(torch.stack(means).mean()) - got["loss"]) > 1e-3


def test_a_mask_without_targets_is_one_line(tmp_path):
    rng = np.random.default_rng(1)
    ds = eval_dataset(chat_corpus(tmp_path / "prompts", rng, answer=False), {"data": {}}, seq_len=SEQ, seed=0,
                      vocab_size=256)
    with pytest.raises(ConfigError) as e:
        evaluate(tiny_gpt(), ds, samples=SAMPLES, batch_size=BATCH, doc_mask=False)
    assert "its loss mask selects no target token" in one_line(e, "--data")
