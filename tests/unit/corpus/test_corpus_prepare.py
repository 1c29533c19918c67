"""mfsdp-data prepare: deterministic, resumable, checksummed; bad input is one line, exit 2."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from helpers import cli
from mfsdp_launch.corpus import shards
from mfsdp_launch.corpus.indexed import MegatronShard
from mfsdp_launch.corpus.prepare import STOP_AFTER_ENV, prepare
from mfsdp_launch.corpus.tokenizer import train_bpe
from mfsdp_launch.data import resolve_text_files

pytest.importorskip("tokenizers")


def data_cli(*args, env=None):
    return cli(*args, module="mfsdp_launch.corpus.prepare", env=env, timeout=300)


@pytest.fixture(scope="module")
def stdlib_texts():
    files = resolve_text_files({"path": None})[:120]
    return [(f, open(f, encoding="utf-8", errors="replace").read()) for f in files]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory, stdlib_texts):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_bpe([t for _, t in stdlib_texts], 1500, str(path))


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, stdlib_texts):
    """A JSON-lines file (one stdlib module per line, plus junk lines) and a directory of text."""
    root = tmp_path_factory.mktemp("inputs")
    with open(root / "docs.jsonl", "w", encoding="utf-8") as f:
        for i, (name, text) in enumerate(stdlib_texts[:80]):
            f.write(json.dumps({"text": text, "name": name}) + "\n")
            if i == 10:
                f.write("{not json\n")
                f.write(json.dumps({"other": "no text field"}) + "\n")
                f.write(json.dumps({"text": ""}) + "\n")  # empty: no document
    (root / "src").mkdir()
    for i, (name, text) in enumerate(stdlib_texts[80:]):
        (root / "src" / f"{i:03d}_{os.path.basename(name)}.txt").write_text(text, encoding="utf-8")
    return root


def files_of(d):
    return {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}


def test_prepare_writes_documents_with_eos_and_is_deterministic(tmp_path, tokenizer, inputs, stdlib_texts):
    args = ([str(inputs / "docs.jsonl"), str(inputs / "src")], tokenizer)
    m1, _ = prepare(*args, str(tmp_path / "a"), workers=1, shard_mb=0.25, show_progress=False)
    m2, _ = prepare(*args, str(tmp_path / "b"), workers=2, shard_mb=0.25, show_progress=False)
    a, b = files_of(tmp_path / "a"), files_of(tmp_path / "b")
    assert a == b and len(m1["shards"]) >= 4  # byte-identical, whatever the worker count
    assert m1["n_documents"] == len(stdlib_texts)  # 80 lines + 40 files; junk and empty lines skipped
    assert m1["skipped"] == {"bad_json": 1, "no_field": 1}
    assert m1["dtype"] == "uint16" and m1["tokenizer"]["vocab_size"] == 1500
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    eos = m1["eos_id"]
    assert eos == tok.token_to_id("<|endoftext|>")
    first = MegatronShard(str(tmp_path / "a" / "shard_000000"))
    doc0 = np.asarray(first.tokens[: first.doc_starts[1]])
    assert doc0[-1] == eos and eos not in doc0[:-1]
    assert tok.decode(doc0[:-1].tolist()) == stdlib_texts[0][1]
    assert sum(s["n_tokens"] for s in m1["shards"]) == m1["n_tokens"]
    # a rerun of a finished preparation is a no-op
    m3, summary = prepare(*args, str(tmp_path / "a"), workers=1, shard_mb=0.25, show_progress=False)
    assert "already prepared" in summary and files_of(tmp_path / "a") == a


def test_interrupted_prepare_resumes_to_identical_output(tmp_path, tokenizer, inputs):
    common = [str(inputs / "docs.jsonl"), str(inputs / "src"), "--tokenizer", tokenizer, "--shard-mb", "0.25",
              "--workers", "2"]
    clean = data_cli("prepare", *common, "--out", str(tmp_path / "clean"))
    assert clean.returncode == 0, clean.stderr
    assert "tokens/s" in clean.stdout
    out = tmp_path / "resumed"
    cut = data_cli("prepare", *common, "--out", str(out), env={STOP_AFTER_ENV: "2"})
    assert cut.returncode == 130, cut.stderr
    assert "rerun the same command" in cut.stderr and "Traceback" not in cut.stderr
    assert not (out / "manifest.json").exists()
    recorded = (out / "progress.jsonl").read_text().splitlines()
    assert len(recorded) == 1 + 2  # header + the two shards recorded before the stop
    (out / "shard_000099.bin.tmp.1.x").write_bytes(b"junk")  # a write a crash cut short
    # Only the recorded shards are kept: another worker may have written a shard it never recorded.
    names = [json.loads(line)["name"] for line in recorded[1:]]
    kept = {f"{n}.idx": os.stat(out / f"{n}.idx").st_mtime_ns for n in names}
    again = data_cli("prepare", *common, "--out", str(out))
    assert again.returncode == 0, again.stderr
    assert all(os.stat(out / n).st_mtime_ns == t for n, t in kept.items())  # recorded shards not redone
    assert files_of(out) == files_of(tmp_path / "clean")


def test_checksum_catches_a_flipped_byte(tmp_path, tokenizer, inputs):
    out = tmp_path / "c"
    prepare([str(inputs / "src")], tokenizer, str(out), workers=1, shard_mb=0.25, show_progress=False)
    assert shards.verify(str(out)) == []
    target = out / "shard_000000.bin"
    raw = bytearray(target.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    target.write_bytes(bytes(raw))
    problems = shards.verify(str(out))
    assert len(problems) == 1 and "shard_000000.bin checksum" in problems[0]
    r = data_cli("verify", str(out))
    assert r.returncode == 1 and "checksum" in r.stderr


def test_parquet_input(tmp_path, tokenizer, stdlib_texts):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    texts = [t for _, t in stdlib_texts[:30]]
    pq.write_table(pa.table({"content": texts}), tmp_path / "d.parquet", row_group_size=7)
    m, _ = prepare([str(tmp_path / "d.parquet")], tokenizer, str(tmp_path / "o"), field="content",
                   workers=1, shard_mb=0.1, show_progress=False)
    assert m["n_documents"] == 30 and len(m["shards"]) > 1
    r = data_cli("prepare", str(tmp_path / "d.parquet"), "--tokenizer", tokenizer, "--out", str(tmp_path / "p"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert "--field: 'text' is not a column" in r.stderr


@pytest.mark.parametrize("case", ["no_input", "no_tokenizer", "empty", "bad_eos", "foreign_out", "workers"])
def test_bad_input_is_one_line_exit_2(tmp_path, tokenizer, inputs, case):
    out = str(tmp_path / "out")
    args = {
        "no_input": [str(tmp_path / "missing.jsonl"), "--tokenizer", tokenizer, "--out", out],
        "no_tokenizer": [str(inputs / "src"), "--tokenizer", str(tmp_path / "nope.json"), "--out", out],
        "empty": [str(tmp_path / "empty.jsonl"), "--tokenizer", tokenizer, "--out", out],
        "bad_eos": [str(inputs / "src"), "--tokenizer", tokenizer, "--out", out, "--eos-token", "<nope>"],
        "foreign_out": [str(inputs / "src"), "--tokenizer", tokenizer, "--out", str(inputs)],
        "workers": [str(inputs / "src"), "--tokenizer", tokenizer, "--out", out, "--workers", "0"],
    }[case]
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n\n')
    r = data_cli("prepare", *args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    expected = {"no_input": "INPUT: ", "no_tokenizer": "--tokenizer: no tokenizer file",
                "empty": "INPUT: no documents", "bad_eos": "--eos-token: '<nope>'",
                "foreign_out": "--out: ", "workers": "--workers: must be >= 1"}[case]
    assert expected in r.stderr
