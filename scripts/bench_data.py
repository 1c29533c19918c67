"""Data benchmark: prepare throughput, opening a large token set, one loader's tokens/s.

  python3 scripts/bench_data.py                  # all three parts; the token set fills what disk allows, <= 20 GB
  python3 scripts/bench_data.py --size-gb 2      # a quicker run
  python3 scripts/bench_data.py --skip-prepare   # parts (b) and (c) only
  python3 scripts/bench_data.py --prepare-only   # part (a) only

(a) ``prepare`` MB/s of text with 1 and 2 workers: the standard library's sources, tokenized by
    a byte-level BPE tokenizer trained here on that text (nothing downloaded).
(b) A synthetic token set of ``--size-gb`` GB (random uint16 tokens, documents ending in EOS,
    Megatron-format shards and a manifest, written here): time to open it and fetch the first
    micro-batch, and the extra host memory, measured in a fresh process. Deleted afterwards
    unless ``--keep``.
(c) One loader process's tokens/s at seq 2048, micro-batch 4 on that set (random positions
    over all of it), and the ratio to the 42,000 tokens/s/GPU the 1.4B GPT trains at on an H200.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mfsdp_launch.corpus import shards  # noqa: E402

GPU_TOKENS_PER_S = 42_000  # 1.4B GPT, seq 2048, mbs 4, bf16, one H200 (bench/results.md)
SHARD_TOKENS = 1 << 27  # 256 MB of uint16 per shard
EOS = 0


def _burn(n: int) -> float:
    t = time.perf_counter()
    s = 0
    for i in range(n):
        s += i * i
    return time.perf_counter() - t


def cpu_scaling() -> float:
    """How many cores' worth of pure-Python work two processes get here (2.0 on two free cores)."""
    import multiprocessing as mp

    one = _burn(5_000_000)
    with mp.get_context("spawn").Pool(2) as pool:
        two = max(pool.map(_burn, [5_000_000] * 2))
    return 2 * one / two


def bench_prepare(tmp: Path, vocab: int) -> None:
    from mfsdp_launch.corpus.prepare import prepare
    from mfsdp_launch.corpus.tokenizer import train_bpe
    from mfsdp_launch.data import resolve_text_files

    files = resolve_text_files({"path": None})
    mb = sum(os.path.getsize(f) for f in files) / 1e6
    t = time.perf_counter()
    texts = (open(f, encoding="utf-8", errors="replace").read() for f in files)
    tok = train_bpe(texts, vocab, str(tmp / "tokenizer.json"))
    print(f"(a) corpus: {len(files)} stdlib files, {mb:.1f} MB; BPE vocab {vocab} trained in "
          f"{time.perf_counter() - t:.1f} s; cores: {len(os.sched_getaffinity(0))}")
    for workers in (1, 2):
        out = tmp / f"prepared_{workers}"
        t = time.perf_counter()
        m, _ = prepare(files, tok, str(out), workers=workers, show_progress=False)
        dt = time.perf_counter() - t
        print(f"(a) prepare, {workers} worker(s): {mb / dt:.2f} MB/s, {m['n_tokens'] / dt / 1e3:,.0f}k tokens/s "
              f"({m['n_tokens']:,} tokens, {len(m['shards'])} shards, {dt:.1f} s wall incl. start-up)")
    print(f"(a) CPU check: two busy processes get {cpu_scaling():.2f} cores' worth of work on this machine "
          f"(2.00 = two free cores)")
    same = all((tmp / "prepared_1" / n).read_bytes() == (tmp / "prepared_2" / n).read_bytes()
               for n in os.listdir(tmp / "prepared_1"))
    print(f"(a) 1- and 2-worker outputs byte-identical: {same}")


def default_size_gb(where: Path, wanted: float) -> float:
    free = shutil.disk_usage(where).free / 1e9
    size = min(wanted, max(0.1, free * 0.5 - 2))  # leave half the free space and 2 GB alone
    if size < wanted:
        print(f"(b) only {free:.0f} GB free under {where}: using {size:.1f} GB instead of {wanted:.0f} GB")
    return size


def make_token_set(out: Path, size_gb: float) -> dict:
    """Random uint16 tokens in documents of ~1000 tokens ending with EOS, plus a manifest."""
    out.mkdir(parents=True)
    total = int(size_gb * 1e9) // 2
    rng = np.random.default_rng(0)
    block = rng.integers(1, 1 << 16, size=SHARD_TOKENS, dtype=np.uint16)  # reused, xor'ed per shard
    entries, t = [], time.perf_counter()
    for i, a in enumerate(range(0, total, SHARD_TOKENS)):
        n = min(SHARD_TOKENS, total - a)
        toks = block[:n] ^ np.uint16(i * 7919 % 65536)
        lengths = rng.geometric(1 / 1000, size=n // 500 + 10)
        ends = np.cumsum(lengths)
        ends = ends[ends < n]
        lengths = np.diff(np.concatenate([[0], ends, [n]]))
        toks[np.append(ends, n) - 1] = EOS
        toks[toks == EOS] = EOS  # (random tokens may also be 0 only at the ends: block starts at 1)
        entries.append(shards.write_shard(str(out), i, toks, lengths))
    meta = {"tokenizer": {"file": "synthetic", "sha256": "synthetic", "vocab_size": 1 << 16},
            "eos_id": EOS, "dtype": "uint16"}
    m = shards.build_manifest(entries, meta)
    shards.write_manifest(str(out), m)
    dt = time.perf_counter() - t
    print(f"(b) wrote {m['n_tokens'] * 2 / 1e9:.1f} GB ({m['n_tokens']:,} tokens, {m['n_documents']:,} documents, "
          f"{len(entries)} shards) in {dt:.0f} s")
    return m


PROBE = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[1])
def rss():
    f = dict(l.split(':', 1) for l in open('/proc/self/status') if l.startswith(('VmRSS', 'RssAnon', 'RssFile')))
    return {k: int(v.split()[0]) * 1024 for k, v in f.items()}
import numpy as np, torch
from mfsdp_launch.corpus import TokenDataset
base = rss()
t = time.perf_counter()
ds = TokenDataset([{"path": sys.argv[2], "weight": 1.0}], seq_len=2048, seed=0, pack=sys.argv[3],
                  val_fraction=0.001)
opened = time.perf_counter() - t
b = ds.batch_numpy(0, 4)
first = time.perf_counter() - t
after_first = rss()
mbs, seq, n, t = 4, 2048, 0, time.perf_counter()
rng = np.random.default_rng(1)
while time.perf_counter() - t < float(sys.argv[4]):
    w = torch.from_numpy(ds.batch_numpy(int(rng.integers(0, 10**9)), mbs))
    batch = {"input_ids": w[:, :-1].contiguous(), "labels": w[:, 1:].contiguous()}
    n += 1
rate = n * mbs * seq / (time.perf_counter() - t)
t, nd = time.perf_counter(), 0
while time.perf_counter() - t < float(sys.argv[4]) / 2:
    toks, ids = ds.batch_numpy(int(rng.integers(0, 10**9)), mbs, with_docs=True)
    nd += 1
rate_docs = nd * mbs * seq / (time.perf_counter() - t)
print(json.dumps(dict(opened=opened, first=first, base=base, after_first=after_first, after_many=rss(),
                      rate=rate, rate_docs=rate_docs, batches=n)))
"""


def bench_load(path: Path, seconds: float) -> None:
    for pack in ("windows", "documents"):
        r = subprocess.run([sys.executable, "-c", PROBE, str(ROOT), str(path), pack, str(seconds)],
                           capture_output=True, text=True, check=True)
        p = json.loads(r.stdout)
        extra = {k: (p["after_first"][k] - p["base"][k]) / 1e6 for k in p["base"]}
        grown = {k: (p["after_many"][k] - p["base"][k]) / 1e6 for k in p["base"]}
        print(f"(b) pack={pack}: open {p['opened']:.3f} s, first batch (4 x 2049) after {p['first']:.3f} s "
              f"(target < 30 s); extra RSS {extra['VmRSS']:.1f} MB (anon {extra['RssAnon']:.1f} MB, "
              f"file-backed {extra['RssFile']:.1f} MB; target < 1000 MB)")
        print(f"(b) pack={pack}: after {p['batches']} random batches: extra RSS {grown['VmRSS']:.1f} MB "
              f"(anon {grown['RssAnon']:.1f} MB; file-backed pages are the page cache, reclaimable)")
        print(f"(c) pack={pack}: one loader process: {p['rate']:,.0f} tokens/s (torch batches), "
              f"{p['rate_docs']:,.0f} tokens/s with document ids; ratio to {GPU_TOKENS_PER_S:,} tokens/s/GPU: "
              f"{p['rate'] / GPU_TOKENS_PER_S:,.0f}x (target >= 20x)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=20.0, help="synthetic token set size (default 20, if it fits)")
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    ap.add_argument("--vocab", type=int, default=8192, help="BPE vocab for part (a)")
    ap.add_argument("--seconds", type=float, default=10.0, help="loader measurement time per pack")
    ap.add_argument("--skip-prepare", action="store_true", help="skip part (a)")
    ap.add_argument("--prepare-only", action="store_true", help="part (a) only")
    ap.add_argument("--keep", action="store_true", help="keep the synthetic token set")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench_data_", dir=a.dir))
    try:
        if not a.skip_prepare:
            bench_prepare(tmp, a.vocab)
        if not a.prepare_only:
            make_token_set(tmp / "tokens", default_size_gb(tmp, a.size_gb))
            bench_load(tmp / "tokens", a.seconds)
    finally:
        if a.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
