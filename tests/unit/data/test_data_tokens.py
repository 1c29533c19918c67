"""data=tokens wired through the config: blends, resume at another DP size, document ids in the
batch, validation batches, and the launcher's checks (check_data_config), without processes."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from helpers import EOS, one_line, write_corpus
from mfsdp_launch.planner import prepare
from mfsdp_launch.corpus import cu_seqlens, doc_ids_from_eos
from mfsdp_launch.data import TokenBatches, check_data_config
from mfsdp_launch.core.errors import ConfigError
from mfsdp_launch.rank.loop import TrainState
from mfsdp_launch.mesh import ParallelDims
from mfsdp_launch.models import build_model_spec
from mfsdp_launch.rank.runtime import Runtime, batch_source, val_batch_source


def ranged_docs(n, lo, hi, seed):
    """Documents of ids in [lo, hi) ending with EOS: the range tells which source a token is from."""
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(lo, hi, size=int(rng.integers(5, 60))), EOS) for _ in range(n)]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {"a": write_corpus(root / "a", ranged_docs(300, 1, 100, 0)),
            "b": write_corpus(root / "b", ranged_docs(300, 100, 200, 1)),
            "v": write_corpus(root / "v", ranged_docs(60, 200, 256, 2)),
            "big": write_corpus(root / "big", ranged_docs(20, 1, 100, 3), vocab=1000, sha="other")}


def config(tmp_path, *overrides):
    cfg, _ = prepare(["model=gpt", "model.preset=tiny", "data=tokens", "train.seq_len=16",
                      "train.micro_batch_size=2", f"data.cache_dir={tmp_path}", *overrides], check_hardware=False)
    return cfg


def blend(a, b, wa=0.7, wb=0.3):
    return f"data.sources=[{{path: '{a}', weight: {wa}}}, {{path: '{b}', weight: {wb}}}]"


def source_of(row):
    t = row[row != EOS]
    return int(np.median(t) >= 100)


def test_blend_proportions_from_the_command_line(corpora, tmp_path):
    cfg = config(tmp_path, blend(corpora["a"], corpora["b"]))
    assert [s.weight for s in cfg.data.sources] == [0.7, 0.3]
    tb = TokenBatches(cfg.data, seq_len=16, micro_batch_size=100, vocab_size=256, seed=cfg.train.seed)
    counts = np.zeros(2)
    for start in range(0, 10_000, 100):
        for row in tb.batch_numpy(start):
            counts[source_of(row)] += 1
    assert np.all(np.abs(counts / counts.sum() - [0.7, 0.3]) < 0.02), counts


def _source(cfg, dp, rank, resumed=None):
    spec = build_model_spec(cfg.model, cfg.train.seq_len)
    dims = ParallelDims(1, dp, 1, 1)
    rt = Runtime(rank=rank, local_rank=0, world_size=dp, device=torch.device("cpu"), control=None, dims=dims,
                 mesh=None)
    return spec, rt, batch_source(cfg, spec, rt, resumed)


def consumed(cfg, dp, steps, resumed=None):
    """The samples (input_ids, doc_ids) of `steps`, in global sample order, as one hash."""
    sources = [_source(cfg, dp, r, resumed)[2] for r in range(dp)]
    h = hashlib.sha256()
    for step in steps:
        for micro in range(cfg.train.grad_accum_steps):
            for next_batch in sources:  # ranks hold consecutive samples (layout.py)
                b = next_batch(step, micro)
                for ids, docs in zip(b["input_ids"].numpy(), b["doc_ids"].numpy()):
                    h.update(ids.tobytes() + docs.tobytes())
    return h.hexdigest()


def test_resume_at_another_dp_size_gives_the_same_samples(corpora, tmp_path):
    over = [blend(corpora["a"], corpora["b"]), "data.pack=documents", "data.doc_mask=true"]
    two = config(tmp_path, *over, "train.grad_accum_steps=2")  # 2 ranks x 2 x 2 = 8 samples a step
    straight = consumed(two, 2, range(3, 6))
    # Saved at step 3 (24 samples); resumed on 1 rank with the same global batch (mbs 4, ga 2) ...
    same = config(tmp_path, *over, "train.grad_accum_steps=2", "train.micro_batch_size=4")
    assert consumed(same, 1, range(3, 6), TrainState(step=3, consumed_samples=24)) == straight
    # ... and on 4 ranks with half the global batch (mbs 1, ga 1): steps 3..8 read samples 24..47.
    half = config(tmp_path, *over, "train.micro_batch_size=1")
    assert consumed(half, 4, range(3, 9), TrainState(step=3, consumed_samples=24)) == straight
    assert consumed(half, 4, range(3, 9)) != straight  # the resumed position is what makes it equal


def test_doc_ids_follow_eos_and_documents_start_samples(corpora, tmp_path):
    cfg = config(tmp_path, f"data.sources=[{{path: '{corpora['a']}'}}]", "data.pack=documents",
                 "data.doc_mask=true", "train.seq_len=64")
    _, _, next_batch = _source(cfg, 1, 0)
    for step in range(5):
        b = next_batch(step, 0)
        assert set(b) == {"input_ids", "labels", "doc_ids", "cu_seqlens"} and b["doc_ids"].shape == b["input_ids"].shape
        assert torch.equal(b["cu_seqlens"], cu_seqlens(b["doc_ids"]))  # computed on the host, for varlen attention
        assert torch.equal(b["doc_ids"], doc_ids_from_eos(b["input_ids"], EOS))
        assert int(b["doc_ids"][:, -1].min()) >= 1  # 64 tokens span documents of 6..61 tokens
    plain = config(tmp_path, f"data.sources=[{{path: '{corpora['a']}'}}]")
    assert set(_source(plain, 1, 0)[2](0, 0)) == {"input_ids", "labels"}


def test_val_batches_are_fixed_split_over_ranks_and_held_out(corpora, tmp_path):
    # val_sources: validation reads only the other corpus (ids >= 200).
    cfg = config(tmp_path, blend(corpora["a"], corpora["b"]), f"data.val_sources=[{{path: '{corpora['v']}'}}]")
    spec, rt, _ = _source(cfg, 1, 0)
    one = val_batch_source(cfg, spec, rt)
    halves = [val_batch_source(cfg, *_source(cfg, 2, r)[:2]) for r in range(2)]
    for i in range(3):
        whole = one(i)["input_ids"]
        assert int(whole[whole != EOS].min()) >= 200
        assert torch.equal(one(i)["input_ids"], whole)  # the same batches at every validation
    # 2 ranks x 2 samples per val step = the first 4 samples of the 1-rank order, split in rank order
    four = config(tmp_path, blend(corpora["a"], corpora["b"]), f"data.val_sources=[{{path: '{corpora['v']}'}}]",
                  "train.micro_batch_size=4")
    whole = val_batch_source(four, *_source(four, 1, 0)[:2])(0)["input_ids"]
    assert torch.equal(torch.cat([h(0)["input_ids"] for h in halves]), whole)
    # val_fraction: the held-out tail of each source, never seen by training
    frac = config(tmp_path, blend(corpora["a"], corpora["b"]), "data.val_fraction=0.2")
    spec, rt, train = _source(frac, 1, 0)
    val = val_batch_source(frac, spec, rt)
    seen = {tuple(r) for s in range(100) for r in train(s, 0)["input_ids"].tolist()}
    held = {tuple(r) for i in range(20) for r in val(i)["input_ids"].tolist()}
    assert seen and held and not seen & held
    assert val_batch_source(config(tmp_path, blend(corpora["a"], corpora["b"])), spec, rt) is None


def test_launcher_checks_are_one_line_each(corpora, tmp_path):
    (tmp_path / "empty.bin").write_bytes(b"")
    a, b = corpora["a"], corpora["b"]
    cases = [
        ([blend(a, str(tmp_path / "nope"))], "data.sources[1].path", "does not exist"),
        ([blend(a, str(tmp_path / "empty.bin"))], "data.sources[1].path", "holds no tokens"),
        ([blend(a, b, wb=0)], "data.sources[1].weight", "must be > 0"),
        ([blend(a, corpora["big"])], "model.vocab_size", "256 is smaller than the vocab 1000"),
        (["data.sources=[]"], "data.sources", "is empty"),
        ([blend(a, b), "train.seq_len=100000"], "data.sources[0].path", "too few"),
        ([blend(a, b), "data.val_fraction=0.1", f"data.val_sources=[{{path: '{corpora['v']}'}}]"],
         "data.val_fraction", "both"),
        ([blend(a, b), f"data.val_sources=[{{path: '{corpora['big']}'}}]"], "model.vocab_size", "val_sources[0]"),
        ([blend(a, b), "train.val_interval=10"], "train.val_interval", "needs held-out data"),
        ([blend(a, b), "data.val_fraction=0.1", "train.val_steps=0"], "train.val_steps", ">= 1"),
        ([blend(a, b), "data.path=x"], "data.path", "does nothing with data=tokens"),
        ([blend(a, b), "data.eos_id=256"], "data.eos_id", "not a token id"),
        (["data=synthetic", "data.doc_mask=true"], "data.doc_mask", "does nothing with data=synthetic"),
        (["data=text", blend(a, b)], "data.sources", "does nothing with data=text"),
        (["data=text", f"data.path={__file__}", "data.pack=documents"], "data.pack", "is one file"),
    ]
    for overrides, key, needle in cases:
        with pytest.raises(ConfigError) as e:
            config(tmp_path, *overrides)
        assert needle in one_line(e, key), (overrides, str(e.value))
    check_data_config({"name": "tokens", "sources": [{"path": a}]}, vocab_size=256)  # plain dicts work too
