"""Training on a blend of prepared corpora with validation, through the CLI on 2 gloo processes:
val rows appear, the training losses are bitwise those of a run without validation, the report
plots them; bad data settings stop the launcher with one line before anything is written."""

from __future__ import annotations

import math

import numpy as np
import pytest

from helpers import EOS, cli, cli_error, read_metrics, train_ranks, write_corpus
from mfsdp_launch.data import resolve_text_files

pytestmark = pytest.mark.slow

BASE = ["engine=fsdp2", "model=gpt", "model.preset=tiny", "data=tokens", "launcher.nproc_per_node=2",
        "train.seq_len=32", "train.micro_batch_size=4", "train.steps=4", "train.log_interval=1",
        "train.progress=false", "optim.warmup_steps=0", "optim.lr=1e-2", "checkpoint.save_final=false",
        "data.pack=documents", "data.doc_mask=true"]


def text_docs(files):
    """Each file's bytes as one document (byte tokens; NUL, absent from text, is the EOS)."""
    return [np.append(np.frombuffer(open(f, "rb").read(20_000), dtype=np.uint8), EOS) for f in files]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("val")
    files = resolve_text_files({"path": None})[:90]
    parts = {"a": files[:40], "b": files[40:70], "v": files[70:]}
    return {"root": root, **{k: write_corpus(root / k, text_docs(fs)) for k, fs in parts.items()}}


def sources(c):
    return f"data.sources=[{{path: '{c['a']}', weight: 0.7}}, {{path: '{c['b']}', weight: 0.3}}]"


def train(run_dir, *overrides):
    """The ranks of `mfsdp-train` (helpers.train_ranks); returns rank 0's output."""
    return train_ranks(*BASE, f"run.dir={run_dir}", *overrides)


def test_validation_rows_and_training_unchanged(corpora, tmp_path):
    plain, val = tmp_path / "plain", tmp_path / "val"
    train(plain, sources(corpora))
    out = train(val, sources(corpora), f"data.val_sources=[{{path: '{corpora['v']}'}}]", "train.val_interval=2",
                "train.val_steps=3")
    base = [(r["step"], r["loss"]) for r in read_metrics(plain)]
    with_val = [(r["step"], r["loss"]) for r in read_metrics(val) if "loss" in r]
    assert len(base) == 4 and with_val == base  # bitwise: validation does not touch training
    vals = [r for r in read_metrics(val) if "val_loss" in r]
    assert [r["step"] for r in vals] == [2, 4] and all("loss" in r for r in vals)  # merged: one row per step
    assert all(r["val_ppl"] == pytest.approx(math.exp(r["val_loss"])) for r in vals)
    assert vals[1]["val_loss"] < vals[0]["val_loss"]  # it learns the held-out text too
    assert "step      4  val_loss" in out

    pytest.importorskip("matplotlib")
    rep = cli(str(val), "--out", str(tmp_path / "rep"), module="mfsdp_launch.tools.report", timeout=120)
    assert rep.returncode == 0, rep.stderr
    assert f"val loss {vals[1]['val_loss']:.4f} @ 4" in rep.stdout
    assert (tmp_path / "rep" / "loss.png").stat().st_size > 1000


def test_bad_data_is_one_line_before_anything_is_written(corpora, tmp_path):
    root = corpora["root"]
    (root / "empty.bin").write_bytes(b"")
    big = write_corpus(root / "big", [np.array([300, 5, EOS])] * 50, vocab=1000, sha="big")
    cases = [
        (f"data.sources=[{{path: '{corpora['a']}'}}, {{path: '{root / 'missing'}'}}]", "data.sources[1].path: ",
         "does not exist"),
        (f"data.sources=[{{path: '{root / 'empty.bin'}'}}]", "data.sources[0].path: ", "holds no tokens"),
        (f"data.sources=[{{path: '{big}'}}]", "model.vocab_size: ", "256 is smaller than the vocab 1000"),
    ]
    for i, (override, key, needle) in enumerate(cases):
        run_dir = tmp_path / f"r{i}"
        line = cli_error(cli(*BASE, f"run.dir={run_dir}", override, timeout=120))
        assert line.startswith(f"mfsdp-train: error: {key}") and needle in line, line
        assert not run_dir.exists()
