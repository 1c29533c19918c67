"""data=tokens: blends, packing, splits, determinism and the launcher's checks (no tokenizer needed)."""

from __future__ import annotations

import hashlib
import pickle

import numpy as np
import pytest

from helpers import EOS, one_line, write_corpus
from mfsdp_launch.corpus import TokenDataset, check_sources, doc_ids_from_eos
from mfsdp_launch.data import microbatch_start
from mfsdp_launch.core.errors import ConfigError


def make_corpus(path, n_docs, *, lo, hi, seed, vocab=1000, per_shard=40, sha="tok-a"):
    """A prepared dir whose documents hold ids in [lo, hi) and end with EOS; returns the docs."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(lo, hi, size=int(rng.integers(5, 120))), EOS) for _ in range(n_docs)]
    write_corpus(path, docs, vocab=vocab, sha=sha, per_shard=per_shard, tokenizer_file="synthetic")
    return docs


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpora")
    return {name: (str(root / name), make_corpus(root / name, 200, lo=lo, hi=lo + 100, seed=i))
            for i, (name, lo) in enumerate([("a", 100), ("b", 300), ("c", 500)])}


def source_of_tokens(t):
    return int((np.median(t[t != EOS]) - 100) // 200)


def test_blend_proportions_within_2_percent(corpora):
    weights = [0.5, 0.3, 0.2]
    ds = TokenDataset([{"path": corpora[n][0], "weight": w} for n, w in zip("abc", weights)], seq_len=32, seed=3)
    counts = np.zeros(3)
    for g in range(10_000):
        counts[source_of_tokens(ds.sample(g))] += 1  # the source read from the tokens themselves
    assert np.all(np.abs(counts / counts.sum() - weights) < 0.02), counts
    shifted = [ds.locate(g)[0] for g in range(25_000, 35_000)]  # any window of 10k, not just the first
    assert np.all(np.abs(np.bincount(shifted, minlength=3) / 10_000 - weights) < 0.02)


def test_samples_are_pure_in_seed_and_index(corpora):
    srcs = [{"path": corpora["a"][0], "weight": 2}, {"path": corpora["b"][0], "weight": 1}]
    ds = TokenDataset(srcs, seq_len=64, seed=11, pack="documents")
    again = pickle.loads(pickle.dumps(TokenDataset(srcs, seq_len=64, seed=11, pack="documents")))
    order = [5, 0, 123456, 7, 99]
    assert all(np.array_equal(ds.sample(g), again.sample(g)) for g in reversed(order))
    other = TokenDataset(srcs, seq_len=64, seed=12, pack="documents")
    assert not all(np.array_equal(ds.sample(g), other.sample(g)) for g in order)


def test_resume_at_another_dp_size_gives_the_same_batches(corpora):
    ds = TokenDataset([corpora["a"][0], corpora["b"][0]], seq_len=16, seed=1)

    def step_hash(step, mbs, dp):  # all ranks' micro-batches of one step, in rank order
        rows = [ds.batch_numpy(microbatch_start(step, 0, micro_batch_size=mbs, grad_accum_steps=1,
                                                dp_rank=r, dp_size=dp), mbs) for r in range(dp)]
        return hashlib.sha256(np.concatenate(rows).tobytes()).hexdigest()

    straight = [step_hash(s, 2, 2) for s in range(6)]
    resumed = [step_hash(s, 2, 2) for s in range(3)] + [step_hash(s, 1, 4) for s in range(3, 6)]
    assert straight == resumed


def test_windows_cover_an_epoch_without_repeats(corpora):
    ds = TokenDataset([corpora["a"][0]], seq_len=31, seed=5)
    p = ds.packers[0]
    starts = [p.start(k) for k in range(p.count)]
    assert len(set(starts)) == p.count
    assert len({s % 32 for s in starts}) == 1  # one grid per epoch
    assert max(starts) + 32 <= ds.streams[0].n_tokens
    nxt = [p.start(k) for k in range(p.count, 2 * p.count)]
    assert nxt != starts


def test_documents_pack_starts_at_documents_and_marks_them(corpora):
    path, docs = corpora["a"]
    ds = TokenDataset([path], seq_len=200, seed=2, pack="documents")
    p, st = ds.packers[0], ds.streams[0]
    doc_starts = set(np.cumsum([0] + [len(d) for d in docs[:-1]]).tolist())
    starts = [p.start(k) for k in range(p.count)]
    assert set(starts) <= doc_starts and len(set(starts)) == p.count
    assert p.count == sum(1 for s in doc_starts if s + 201 <= st.n_tokens)
    for g in range(50):
        toks, ids = ds.sample_with_docs(g)
        assert np.array_equal(ids, doc_ids_from_eos(toks, EOS))  # index and EOS agree
        assert ids[0] == 0 and ids[-1] >= 1  # 201 tokens span several short documents


@pytest.mark.parametrize("pack", ["windows", "documents"])
def test_val_split_is_disjoint_by_documents(corpora, pack):
    srcs = [corpora["a"][0], corpora["b"][0]]
    kw = dict(seq_len=48, seed=4, pack=pack, val_fraction=0.2)
    train, val = TokenDataset(srcs, split="train", **kw), TokenDataset(srcs, split="val", **kw)

    def docs_touched(ds, n):
        seen = set()
        for g in range(n):
            s, start = ds.locate(g)
            st = ds.streams[s]
            seen |= {(s, d) for d in range(st.doc_at(start), st.doc_at(start + 48) + 1)}
        return seen

    tr, va = docs_touched(train, 3000), docs_touched(val, 500)
    assert tr and va and not (tr & va)
    for s in (0, 1):
        st = train.streams[s]
        val_docs = {d for (src, d) in va if src == s}
        assert min(val_docs) > max(d for (src, d) in tr if src == s)
        assert abs(st.n_tokens - st.doc_start(min(val_docs)) - 0.2 * st.n_tokens) < 0.05 * st.n_tokens


def test_check_sources_errors_are_one_line(corpora, tmp_path):
    a = corpora["a"][0]
    (tmp_path / "empty.bin").write_bytes(b"")
    cases = [
        ([{"path": str(tmp_path / "nope"), "weight": 1}], {}, "data.sources[0].path", "does not exist"),
        ([a, {"path": str(tmp_path / "empty.bin")}], {}, "data.sources[1].path", "holds no tokens"),
        ([{"path": a, "weight": 0}], {}, "data.sources[0].weight", "must be > 0"),
        ([{"path": a, "weight": "x"}], {}, "data.sources[0].weight", "not a number"),
        ([a], {"model_vocab": 512}, "model.vocab_size", "smaller than the vocab 1000"),
        ([a], {"seq_len": 10**7}, "data.sources[0].path", "too few"),
        ([a], {"pack": "random"}, "data.pack", "unknown"),
        ([a], {"val_fraction": 1.0}, "data.val_fraction", "outside"),
        ([], {}, "data.sources", "is empty"),
    ]
    for sources, kw, key, needle in cases:
        with pytest.raises(ConfigError) as e:
            check_sources(sources, **kw)
        assert needle in one_line(e, key)
    assert [s.n_tokens for s in check_sources([a], seq_len=64, model_vocab=1000)] == [
        sum(len(d) for d in corpora["a"][1])]


def test_mixed_tokenizers_and_flat_documents_are_refused(corpora, tmp_path):
    make_corpus(tmp_path / "other", 20, lo=100, hi=200, seed=9, sha="tok-b")
    with pytest.raises(ConfigError) as e:
        check_sources([corpora["a"][0], str(tmp_path / "other")])
    assert "another tokenizer" in one_line(e, "data.sources[1].path")
    np.arange(5000, dtype=np.uint16).tofile(tmp_path / "flat.bin")
    with pytest.raises(ConfigError) as e:
        check_sources([str(tmp_path / "flat.bin")], pack="documents")
    assert "set data.eos_id" in one_line(e, "data.pack")
    with pytest.raises(ConfigError) as e:
        TokenDataset([str(tmp_path / "flat.bin")], seq_len=16, seed=0, split="val")
    one_line(e, "data.val_fraction")
    ds = TokenDataset([str(tmp_path / "flat.bin")], seq_len=16, seed=0, val_fraction=0.1, split="val")
    assert ds.sample(0).min() >= 4500  # a single-document source is cut at the token


def test_flat_bin_split_at_eos_packs_documents(tmp_path):
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(1, 100, size=int(rng.integers(10, 80))), 0) for _ in range(100)]
    np.concatenate(docs).astype(np.uint16).tofile(tmp_path / "train.bin")
    ds = TokenDataset([str(tmp_path / "train.bin")], seq_len=64, seed=0, pack="documents", eos_id=0,
                      cache_dir=str(tmp_path / "cache"))
    assert ds.streams[0].n_docs == 100
    starts = set(np.cumsum([0] + [len(d) for d in docs[:-1]]).tolist())
    for g in range(200):
        s, start = ds.locate(g)
        assert start in starts
        toks, ids = ds.sample_with_docs(g)
        assert np.array_equal(ids, doc_ids_from_eos(toks, 0))
