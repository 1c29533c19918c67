"""Readers for corpora users already have: Megatron .bin/.idx and nanoGPT / llm.c flat .bin."""

from __future__ import annotations

import mmap
import struct

import numpy as np
import pytest

from mfsdp_launch.corpus.formats import FlatShard
from mfsdp_launch.corpus.indexed import MegatronShard, write_index
from mfsdp_launch.corpus.sources import resolve
from mfsdp_launch.corpus.stream import TokenStream
from mfsdp_launch.core.errors import ConfigError

CODES = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4, np.dtype(np.uint8): 1}


def megatron_write(prefix, docs, dtype):
    """Megatron's layout written out by hand from its spec (independent of indexed.write_index)."""
    dtype = np.dtype(dtype)
    lengths = [len(d) for d in docs]
    pointers, p = [], 0
    for n in lengths:
        pointers.append(p)
        p += n * dtype.itemsize
    with open(prefix + ".bin", "wb") as f:
        for d in docs:
            f.write(np.asarray(d, dtype=dtype).tobytes())
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", CODES[dtype]))
        f.write(struct.pack("<Q", len(docs)))
        f.write(struct.pack("<Q", len(docs) + 1))
        f.write(struct.pack(f"<{len(docs)}i", *lengths))
        f.write(struct.pack(f"<{len(docs)}q", *pointers))
        f.write(struct.pack(f"<{len(docs) + 1}q", *range(len(docs) + 1)))


def random_docs(seed, n, vocab):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(1, 60))) for _ in range(n)]


@pytest.mark.parametrize("dtype,vocab", [(np.uint16, 50000), (np.int32, 150000)])
def test_megatron_reader_reads_what_megatron_layout_holds(tmp_path, dtype, vocab):
    docs = random_docs(0, 40, vocab)
    megatron_write(str(tmp_path / "m"), docs, dtype)
    for spec in ("m", "m.bin", "m.idx"):
        src = resolve(str(tmp_path / spec), key="k")
        assert src.kinds == ["megatron"]
    sh = MegatronShard(str(tmp_path / "m"))
    assert sh.dtype == np.dtype(dtype) and sh.n_docs == 40 and sh.n_tokens == sum(map(len, docs))
    assert isinstance(sh.tokens.base.obj, mmap.mmap)  # mapped, not read
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
    assert np.array_equal(sh.doc_starts[:], starts)
    assert np.array_equal(np.asarray(sh.tokens), np.concatenate(docs))
    # our writer produces the same index bytes as the hand-written layout
    with open(tmp_path / "ours.idx", "wb") as f:
        write_index(f, dtype, np.array([len(d) for d in docs]))
    assert (tmp_path / "ours.idx").read_bytes() == (tmp_path / "m.idx").read_bytes()


def test_megatron_non_contiguous_is_refused(tmp_path):
    megatron_write(str(tmp_path / "m"), random_docs(1, 5, 100), np.uint16)
    with open(tmp_path / "m.bin", "ab") as f:
        f.write(b"\0\0")  # a token the index does not account for
    with pytest.raises(ConfigError, match="not contiguous"):
        resolve(str(tmp_path / "m"), key="data.sources[0].path")


def test_nanogpt_flat_bin_one_stream_or_split_at_eos(tmp_path):
    eos = 7
    docs = [np.append(np.random.default_rng(i).integers(10, 500, size=5 + 3 * i), eos) for i in range(6)]
    flat = np.concatenate(docs).astype(np.uint16)
    flat.tofile(tmp_path / "train.bin")  # nanoGPT: raw uint16, no header
    sh = FlatShard(str(tmp_path / "train.bin"))
    assert sh.n_tokens == len(flat) and sh.n_docs == 1
    assert np.array_equal(np.asarray(sh.tokens), flat)
    split = FlatShard(str(tmp_path / "train.bin"), eos_id=eos, cache_dir=str(tmp_path / "cache"))
    assert split.n_docs == 6
    assert np.array_equal(split.doc_starts[:], np.cumsum([0] + [len(d) for d in docs[:-1]]))
    again = FlatShard(str(tmp_path / "train.bin"), eos_id=eos, cache_dir=str(tmp_path / "cache"))
    assert isinstance(again.doc_starts.arr, np.memmap)  # the cached index is memmapped


def test_llmc_header_bin(tmp_path):
    tokens = np.arange(1000, dtype=np.uint16)
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (20240520, 1, len(tokens))
    with open(tmp_path / "fineweb_train_000001.bin", "wb") as f:
        f.write(header.tobytes() + tokens.tobytes())
    tokens32 = np.arange(70000, 70500, dtype=np.uint32)
    header[1:3] = (2, len(tokens32))
    with open(tmp_path / "fineweb_train_000002.bin", "wb") as f:
        f.write(header.tobytes() + tokens32.tobytes())
    src = resolve(str(tmp_path / "fineweb_train_*.bin"), key="k")
    assert src.kinds == ["flat", "flat"] and src.n_tokens == 1500
    st = TokenStream(src.shards)
    assert np.array_equal(st.read(990, 20), np.concatenate([np.arange(990, 1000), np.arange(70000, 70010)]))


def test_unknown_paths_are_config_errors(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "plain").mkdir()
    (tmp_path / "odd.bin").write_bytes(b"\0\0\0")
    for spec, needle in [("missing", "does not exist"), ("notes.txt", "not a known format"),
                         ("plain", "without manifest.json"), ("*.txt", "but no corpus"),
                         ("odd.bin", "not a whole number")]:
        with pytest.raises(ConfigError) as e:
            resolve(str(tmp_path / spec), key="data.sources[0].path")
        assert str(e.value).startswith("data.sources[0].path: ") and needle in str(e.value)
        assert "\n" not in str(e.value)
