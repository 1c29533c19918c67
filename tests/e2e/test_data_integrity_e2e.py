"""Damaged token shards through the CLI: a same-size corruption in a sampled block of a prepared
shard is refused in one line naming the file before anything is spawned, and `mfsdp-data verify`
finds a corruption anywhere. (The data=text cache: tests/unit/data/test_data.py, and rebuilt
before spawning in tests/e2e/test_bad_steps_e2e.py.)"""

from __future__ import annotations

import json
import os

import numpy as np

from helpers import EOS, cli, cli_error, write_corpus
from mfsdp_launch.corpus import check_integrity, shards


def flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


def test_a_damaged_shard_is_refused_before_spawning_and_verify_checks_every_byte(tmp_path):
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(1, 256, size=int(rng.integers(100, 400))), EOS) for _ in range(100)]
    corpus = write_corpus(tmp_path / "corpus", docs, per_shard=100)  # one shard of ~50 KB
    bin_path = os.path.join(corpus, "shard_000000.bin")
    size = os.path.getsize(bin_path)
    entry = json.loads(open(os.path.join(corpus, "manifest.json")).read())["shards"][0]["files"]["bin"]
    assert entry["sample"] == {"block": shards.SAMPLE_BLOCK, "blocks": shards.SAMPLE_BLOCKS,
                               "checksum": shards.sampled_checksum(bin_path)}
    blocks = shards.sample_offsets(size)
    assert len(blocks) == shards.SAMPLE_BLOCKS and blocks[0][0] == 0 and sum(b[0] + b[1] == size for b in blocks) == 1

    run = tmp_path / "run"
    flip(bin_path, blocks[1][0] + 7)  # inside the second sampled block, same size
    out = cli("+recipe=cpu_smoke", "model.preset=tiny", "data=tokens", f"data.sources=[{{path: '{corpus}'}}]",
              "train.seq_len=32", "train.steps=2", f"run.dir={run}")
    line = cli_error(out)
    assert line.startswith(f"mfsdp-train: error: data.sources[0].path: {bin_path} is damaged: its sampled checksum "), line
    assert f"`mfsdp-data verify {corpus}` checks every byte" in line
    assert "ranks" not in out.stdout and not (run / "logs").exists()  # nothing spawned

    # A corruption between the sampled blocks: the launcher's check reads past it, verify does not.
    flip(bin_path, blocks[1][0] + 7)
    flip(bin_path, blocks[0][1] + 100)
    assert blocks[0][1] + 100 < blocks[1][0]
    check_integrity([{"path": corpus}])  # sampled: passes
    out = cli("verify", corpus, module="mfsdp_launch.corpus.prepare")
    assert out.returncode == 1 and f"{bin_path} checksum " in out.stderr and "!= manifest" in out.stderr, out.stderr
    flip(bin_path, blocks[0][1] + 100)
    ok = cli("verify", corpus, module="mfsdp_launch.corpus.prepare")
    assert ok.returncode == 0 and "all shards match the manifest" in ok.stdout
