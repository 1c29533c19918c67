"""Tests for mfsdp_launch.data: deterministic position-addressed token batches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from helpers import ROOT
from mfsdp_launch import data as D
from mfsdp_launch.core.schema import DataConfig


def _tb(cfg, *, seq_len=16, mbs=4, vocab=300, seed=7, dp_rank=0, dp_size=1, split="train"):
    return D.TokenBatches(cfg, seq_len=seq_len, micro_batch_size=mbs, vocab_size=vocab, seed=seed,
                          dp_rank=dp_rank, dp_size=dp_size, split=split)


@pytest.fixture
def corpus(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / ".hidden").mkdir()
    (root / "a.txt").write_text("alpha " * 200)
    (root / "b.md").write_text("# beta\n" * 100)
    (root / "sub" / "c.py").write_text("print('gamma')\n" * 50)
    (root / "ignored.bin").write_bytes(b"\x00" * 100)
    (root / ".hidden" / "x.txt").write_text("hidden")
    return root


@pytest.fixture
def cache(tmp_path):
    return str(tmp_path / "cache")


def _text_cfg(cache, path=None, max_bytes=100_000, tokenizer=None):
    return DataConfig(name="text", path=None if path is None else str(path), cache_dir=cache,
                      max_bytes=max_bytes, tokenizer=tokenizer)


# ---------------------------------------------------------------------------------- layout


def test_layout_formula():
    assert D.samples_per_step(2, 3, 4) == 24
    kw = dict(micro_batch_size=2, grad_accum_steps=3, dp_size=4)
    assert D.microbatch_start(0, 0, dp_rank=0, **kw) == 0
    assert D.microbatch_start(0, 0, dp_rank=3, **kw) == 6
    assert D.microbatch_start(0, 2, dp_rank=1, **kw) == 2 * 8 + 2
    assert D.microbatch_start(5, 1, dp_rank=2, **kw) == (5 * 3 + 1) * 8 + 4
    # every step covers exactly [s*S, (s+1)*S) once, over ranks and micro-batches
    for s in range(3):
        idx = sorted(
            D.microbatch_start(s, m, dp_rank=r, **kw) + i
            for m in range(3) for r in range(4) for i in range(2)
        )
        assert idx == list(range(s * 24, (s + 1) * 24))
    with pytest.raises(ValueError):
        D.microbatch_start(0, 3, dp_rank=0, **kw)
    with pytest.raises(ValueError):
        D.microbatch_start(0, 0, dp_rank=4, **kw)


def test_dp_ranks_disjoint_and_cover():
    cfg = DataConfig(name="synthetic")
    for step in range(3):
        for m in range(2):
            one = _tb(cfg, mbs=4).microbatch(step, m, grad_accum_steps=2)
            parts = [_tb(cfg, mbs=2, dp_rank=r, dp_size=2).microbatch(step, m, grad_accum_steps=2)
                     for r in range(2)]
            starts = [D.microbatch_start(step, m, micro_batch_size=2, grad_accum_steps=2,
                                         dp_rank=r, dp_size=2) for r in range(2)]
            assert set(range(starts[0], starts[0] + 2)).isdisjoint(range(starts[1], starts[1] + 2))
            for k in ("input_ids", "labels"):
                assert np.array_equal(np.concatenate([p[k].numpy() for p in parts]), one[k].numpy())


# ---------------------------------------------------------------------------------- synthetic


def test_synthetic_deterministic_and_seeded():
    cfg = DataConfig(name="synthetic")
    a, b = _tb(cfg, seed=1), _tb(cfg, seed=1)
    for g in (0, 4, 1000):
        ba, bb = a.batch(g), b.batch(g)
        assert ba["input_ids"].equal(bb["input_ids"]) and ba["labels"].equal(bb["labels"])
    assert not a.batch(0)["input_ids"].equal(_tb(cfg, seed=2).batch(0)["input_ids"])
    assert not a.batch(0)["input_ids"].equal(a.batch(4)["input_ids"])
    # sample g does not depend on the micro-batch it lands in
    assert a.batch(2)["input_ids"][0].equal(a.batch(0)["input_ids"][2])


def test_synthetic_shapes_labels_range():
    import torch

    tb = _tb(DataConfig(name="synthetic"), seq_len=32, mbs=3, vocab=50)
    assert tb.vocab_size == 50
    b = tb.batch(10)
    for k in ("input_ids", "labels"):
        assert b[k].shape == (3, 32) and b[k].dtype == torch.long and b[k].device.type == "cpu"
        assert int(b[k].min()) >= 0 and int(b[k].max()) < 50
    assert b["input_ids"][:, 1:].equal(b["labels"][:, :-1])
    w = tb.sample(10)
    assert np.array_equal(b["input_ids"][0].numpy(), w[:-1])
    assert np.array_equal(b["labels"][0].numpy(), w[1:])


def test_resume_equals_continuing():
    cfg = DataConfig(name="synthetic")
    kw = dict(mbs=2, dp_size=2, dp_rank=1)
    run = _tb(cfg, **kw)
    full = [run.microbatch(s, m, grad_accum_steps=2)["input_ids"] for s in range(6) for m in range(2)]
    resumed = _tb(cfg, **kw)  # a fresh process after loading step 3
    rest = [resumed.microbatch(s, m, grad_accum_steps=2)["input_ids"] for s in range(3, 6) for m in range(2)]
    assert all(x.equal(y) for x, y in zip(full[6:], rest))

    # resume at another DP size (and global batch size) from consumed_samples
    consumed = 3 * D.samples_per_step(2, 2, 2)
    r = _tb(cfg, mbs=4, dp_size=1)
    first = r.batch(D.microbatch_start(3, 0, micro_batch_size=4, grad_accum_steps=1, dp_rank=0,
                                       dp_size=1, base_step=3, base_samples=consumed))
    ref = _tb(cfg, mbs=1)
    for i in range(4):
        assert first["input_ids"][i].equal(ref.batch(consumed + i)["input_ids"][0])


# ---------------------------------------------------------------------------------- text


def all_tokens(tb):
    """Every token of a text config's cached corpus, as int64."""
    return tb.dataset.streams[0].read(0, tb.n_tokens)


def test_text_tmp_corpus(corpus, cache):
    tb = _tb(_text_cfg(cache, corpus), seq_len=8, mbs=3)
    assert tb.vocab_size == 256
    srcs = [os.path.relpath(s, corpus) for s in tb.meta["inputs"]]
    assert srcs == ["a.txt", "b.md", os.path.join("sub", "c.py")]
    expected = b"\n\n".join((corpus / s).read_bytes() for s in srcs)
    assert tb.n_tokens == len(expected) and tb.meta["dtype"] == "uint8"
    assert bytes(all_tokens(tb).astype(np.uint8)) == expected
    # the cache is a prepared corpus: one document per file (with its separator), checksums that verify
    from mfsdp_launch.corpus import verify

    assert tb.meta["n_documents"] == 3 and verify(tb.path) == []
    b = tb.batch(5)
    assert b["input_ids"].shape == (3, 8)
    assert b["input_ids"][:, 1:].equal(b["labels"][:, :-1])
    for i in range(3):  # each sample is a contiguous window of the corpus
        w = bytes(b["input_ids"][i].tolist()) + bytes([int(b["labels"][i, -1])])
        assert w in expected
    again = _tb(_text_cfg(cache, corpus), seq_len=8, mbs=3)
    assert again.batch(5)["input_ids"].equal(b["input_ids"])
    other = _tb(_text_cfg(cache, corpus), seq_len=8, mbs=3, seed=8)
    assert not other.batch(5)["input_ids"].equal(b["input_ids"])


def test_text_file_glob_and_max_bytes(corpus, cache):
    one = _tb(_text_cfg(cache, corpus / "a.txt"), seq_len=8)
    assert one.meta["inputs"] == [str(corpus / "a.txt")] and one.n_tokens == 1200
    g = _tb(_text_cfg(cache, str(corpus / "**" / "*.py")), seq_len=8)
    assert g.meta["inputs"] == [str(corpus / "sub" / "c.py")]
    cut = _tb(_text_cfg(cache, corpus, max_bytes=1300), seq_len=8)
    assert cut.n_tokens == 1300
    assert cut.meta["inputs"] == [str(corpus / "a.txt"), str(corpus / "b.md")]
    assert bytes(all_tokens(cut).astype(np.uint8)) == ((corpus / "a.txt").read_bytes() + b"\n\n"
                                                         + (corpus / "b.md").read_bytes())[:1300]


def test_text_default_stdlib(cache):
    tb = _tb(_text_cfg(cache, None, max_bytes=300_000), seq_len=64, mbs=2)
    assert tb.n_tokens == 300_000 and tb.vocab_size == 256
    stdlib = D.stdlib_dir()
    srcs = tb.meta["inputs"]
    assert srcs == sorted(srcs) and len(srcs) > 1
    for s in srcs:
        assert s.startswith(stdlib) and s.endswith(".py")
        parts = set(os.path.relpath(s, stdlib).split(os.sep))
        assert not parts & {"site-packages", "test", "tests", "idlelib"}
    b = tb.batch(0)
    assert b["input_ids"].shape == (2, 64) and int(b["input_ids"].max()) < 256


def test_text_val_fraction_holds_out_the_last_files(corpus, cache):
    cfg = _text_cfg(cache, corpus)
    cfg.val_fraction = 0.2
    train, val = _tb(cfg, seq_len=8, mbs=4), _tb(cfg, seq_len=8, mbs=4, split="val")
    text = bytes(all_tokens(train).astype(np.uint8))
    cut = text.index(b"print")  # c.py, the last file, is the held-out tail (a document boundary)
    for g in range(0, 200, 4):
        for row in train.batch_numpy(g):
            assert bytes(row.astype(np.uint8)) in text[:cut]
        for row in val.batch_numpy(g):
            assert bytes(row.astype(np.uint8)) in text[cut:]


def test_cache_reused_and_invalidated(corpus, cache):
    cfg = _text_cfg(cache, corpus)
    tb = _tb(cfg, seq_len=8)
    manifest = os.path.join(tb.path, "manifest.json")
    st_meta = os.stat(manifest).st_mtime_ns
    time.sleep(0.02)
    tb2 = _tb(cfg, seq_len=8)
    assert tb2.path == tb.path and os.stat(manifest).st_mtime_ns == st_meta
    # editing a source (size + mtime) gives a new cache directory
    (corpus / "a.txt").write_text("changed " * 100)
    tb3 = _tb(cfg, seq_len=8)
    assert tb3.path != tb.path and tb3.n_tokens != tb.n_tokens
    # a torn cache (manifest present, shard of the wrong size) is rebuilt, not trusted
    with open(os.path.join(tb3.path, "shard_000000.bin"), "r+b") as f:
        f.truncate(10)
    tb4 = _tb(cfg, seq_len=8)
    assert os.path.getsize(os.path.join(tb4.path, "shard_000000.bin")) == tb4.n_tokens == tb3.n_tokens


def test_a_same_size_damage_in_the_cache_is_rebuilt_never_read(corpus, cache, capfd):
    cfg = _text_cfg(cache, corpus)
    path, _ = D.build_token_cache(cfg)
    shard = os.path.join(path, "shard_000000.bin")
    good = open(shard, "rb").read()
    with open(shard, "r+b") as f:  # one byte in the middle, size unchanged
        f.seek(len(good) // 2)
        f.write(bytes([good[len(good) // 2] ^ 0xFF]))
    capfd.readouterr()
    tb = _tb(cfg, seq_len=8)
    assert tb.path == path and open(shard, "rb").read() == good  # rebuilt before the batches read it
    err = capfd.readouterr().err
    assert f"the token cache {path} was damaged ({shard} checksum" in err and "rebuilt it" in err


def test_cache_dir_env(corpus, tmp_path, monkeypatch):
    env_dir = tmp_path / "envcache"
    monkeypatch.setenv("MFSDP_CACHE_DIR", str(env_dir))
    tb = _tb(DataConfig(name="text", path=str(corpus)), seq_len=8)
    assert os.path.dirname(tb.path) == str(env_dir)
    explicit = _tb(_text_cfg(str(tmp_path / "explicit"), corpus), seq_len=8)
    assert os.path.dirname(explicit.path) == str(tmp_path / "explicit")


def test_concurrent_builds(tmp_path, cache):
    root = tmp_path / "big"
    root.mkdir()
    rng = np.random.default_rng(0)
    for i in range(20):
        (root / f"f{i:02d}.txt").write_bytes(rng.integers(32, 127, 200_000, dtype=np.uint8).tobytes())
    script = textwrap.dedent(
        f"""
        import sys, time, zlib
        sys.path.insert(0, {str(ROOT)!r})
        from mfsdp_launch.data import TokenBatches
        from mfsdp_launch.core.schema import DataConfig
        t0 = float(sys.argv[1])
        while time.time() < t0:
            pass
        tb = TokenBatches(DataConfig(name="text", path={str(root)!r}, cache_dir={cache!r}),
                          seq_len=32, micro_batch_size=2, vocab_size=256, seed=0)
        toks = tb.dataset.streams[0].read(0, tb.n_tokens).astype("uint8")
        print(tb.path, tb.n_tokens, zlib.crc32(toks.tobytes()))
        """
    )
    start = str(time.time() + 1.0)
    procs = [subprocess.Popen([sys.executable, "-c", script, start], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        outs.append(out.split())
    assert outs[0] == outs[1]
    (entry,) = os.listdir(cache)
    files = sorted(os.listdir(os.path.join(cache, entry)))
    assert files == ["manifest.json", "shard_000000.bin", "shard_000000.idx"], files  # no temporaries left
    expected = b"\n\n".join((root / f"f{i:02d}.txt").read_bytes() for i in range(20))
    assert len(expected) == int(outs[0][1])
    assert open(os.path.join(cache, entry, "shard_000000.bin"), "rb").read() == expected


# ---------------------------------------------------------------------------------- errors


def test_error_bad_path(tmp_path, cache):
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(ValueError, match=r"^data\.path: .*nope\.txt.*does not exist"):
        D.check_data_config(_text_cfg(cache, missing), vocab_size=256)
    pattern = str(tmp_path / "*.nothing")
    with pytest.raises(ValueError, match=r"^data\.path: no files match '.*\*\.nothing'"):
        D.check_data_config(_text_cfg(cache, pattern), vocab_size=256)
    with pytest.raises(ValueError, match=r"^data\.path: no files match"):
        _tb(_text_cfg(cache, pattern), vocab=256)
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match=r"^data\.path: directory .*empty"):
        D.check_data_config(_text_cfg(cache, empty_dir), vocab_size=256)
    with pytest.raises(ValueError, match=r"^data\.name: "):
        D.check_data_config(DataConfig(name="bogus"), vocab_size=256)


def test_error_corpus_too_small(tmp_path, cache):
    f = tmp_path / "tiny.txt"
    f.write_text("0123456789")
    with pytest.raises(ValueError, match=r"^data\.path: .*tiny\.txt.*10 tokens.*seq_len \+ 1 = 17"):
        _tb(_text_cfg(cache, f), seq_len=16)
    _tb(_text_cfg(cache, f), seq_len=9)  # exactly seq_len + 1 tokens is enough
    with pytest.raises(ValueError, match=r"data\.path: .*4 tokens.*max_bytes=4"):
        _tb(_text_cfg(cache, f, max_bytes=4), seq_len=8)


def test_error_vocab_too_small(corpus, tmp_path, cache):
    with pytest.raises(ValueError, match=r"^model\.vocab_size: 100 .* 256"):
        D.check_data_config(_text_cfg(cache, corpus), vocab_size=100)
    with pytest.raises(ValueError, match=r"^model\.vocab_size"):
        _tb(_text_cfg(cache, corpus), vocab=255)
    D.check_data_config(DataConfig(name="synthetic"), vocab_size=100)  # no tokenizer involved
    tok = tmp_path / "tokenizer.json"
    tok.write_text(json.dumps({
        "model": {"type": "WordLevel", "vocab": {f"w{i}": i for i in range(1000)}, "unk_token": "w0"},
        "added_tokens": [{"id": 1000, "content": "<eos>"}],
    }))
    assert D.tokenizer_vocab_size(_text_cfg(cache, corpus, tokenizer=str(tok))) == 1001
    with pytest.raises(ValueError, match=r"^model\.vocab_size: 512 .* 1001"):
        D.check_data_config(_text_cfg(cache, corpus, tokenizer=str(tok)), vocab_size=512)
    D.check_data_config(_text_cfg(cache, corpus, tokenizer=str(tmp_path)), vocab_size=1001)
    with pytest.raises(ValueError, match=r"^data\.tokenizer: "):
        D.check_data_config(_text_cfg(cache, corpus, tokenizer=str(tmp_path / "x.json")),
                            vocab_size=5000)


def test_tokenizers_missing_is_runtime_error(corpus, tmp_path, cache, monkeypatch):
    tok = tmp_path / "tokenizer.json"
    tok.write_text(json.dumps({"model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1}}}))
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import now raises ImportError
    with pytest.raises(RuntimeError, match="tokenizers"):
        _tb(_text_cfg(cache, corpus, tokenizer=str(tok)), vocab=1000)


def test_hf_tokenizer(corpus, tmp_path, cache):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers

    vocab = {"[UNK]": 0, "alpha": 1, "#": 2, "beta": 3, "print": 4, "(": 5, "'": 6, "gamma": 7, ")": 8}
    tk = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "tok" / "tokenizer.json"
    path.parent.mkdir()
    tk.save(str(path))
    tb = _tb(_text_cfg(cache, corpus, tokenizer=str(path)), seq_len=8, vocab=9)
    assert tb.vocab_size == 9 and tb.meta["dtype"] == "uint8"
    texts = [(corpus / n).read_text() for n in ("a.txt", "b.md", os.path.join("sub", "c.py"))]
    expected = [i for t in texts for i in tk.encode(t, add_special_tokens=False).ids]
    assert tb.n_tokens == len(expected) > 400  # "\n\n" encodes to nothing here
    assert all_tokens(tb).tolist() == expected
    assert tb.meta["tokenizer"]["vocab_size"] == 9 and tb.meta["n_documents"] == 3
    b = tb.batch(0)
    assert b["input_ids"][:, 1:].equal(b["labels"][:, :-1])


def test_check_data_config_does_not_import_torch(corpus, cache):
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from mfsdp_launch.data import check_data_config
        from mfsdp_launch.core.schema import DataConfig
        check_data_config(DataConfig(name="text", path={str(corpus)!r}, cache_dir={cache!r}), vocab_size=256)
        check_data_config(DataConfig(name="text", max_bytes=1000), vocab_size=256)
        check_data_config(DataConfig(name="synthetic"), vocab_size=32)
        assert "torch" not in sys.modules, "torch was imported"
        print("ok")
        """
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_pickles_without_the_map(corpus, cache):
    import pickle

    tb = _tb(_text_cfg(cache, corpus), seq_len=8)
    ref = tb.batch(3)["input_ids"]
    clone = pickle.loads(pickle.dumps(tb))  # e.g. a DataLoader worker
    assert clone.dataset.streams[0].shards[0]._tokens is None and clone.batch(3)["input_ids"].equal(ref)
    assert len(pickle.dumps(tb)) < 10_000
