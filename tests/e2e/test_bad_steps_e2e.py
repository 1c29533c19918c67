"""Non-finite steps (rank/step_guard.py), as mfsdp-train's ranks run them and through the CLI: a
user's model returns NaN logits at chosen forward calls, on one rank only. A bad step is skipped on
every rank alike (the weights of both FSDP shards unchanged across it), counted in metrics, and
never committed; bad steps in a row roll back to the last checkpoint before them and training goes
on; bad steps that persist after train.max_rollbacks stop the run with one line naming the step and
exit code 5. (And, in the same run to save a start-up, a data=text token cache damaged at the same
size is rebuilt by the launcher before the ranks open it.)"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers import cli, read_metrics, train_ranks, train_rows, write_user_module

torch = pytest.importorskip("torch")

NAN_MODULE = "mfsdp_test_nanmodel"
# The README's model, whose forward returns NaN logits at the 1-based training calls listed in $NAN_CALLS
# ("4-" means from call 4 on), on the rank $NAN_RANK only (every rank when unset). A call counter,
# not the step: after a rollback the replayed steps are clean unless listed again. It counts on the
# device, so a replayed CUDA graph (which runs no Python) counts too; a plain attribute, so no
# checkpoint holds it and a rollback does not rewind it.
NAN_SOURCE = '''
import os

import torch
import torch.nn as nn


def _bad_calls(device):
    """(the listed calls, the first call of an "N-" range or -1) as device tensors; none listed
    on ranks other than $NAN_RANK."""
    rank = os.environ.get("NAN_RANK")
    listed, start = [], -1
    if rank is None or rank == os.environ.get("RANK", "0"):
        for part in filter(None, os.environ.get("NAN_CALLS", "").split(",")):
            if part.endswith("-"):
                start = int(part[:-1])
            else:
                listed.append(int(part))
    return torch.tensor(listed or [-1], device=device), torch.tensor(start, device=device)


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        return x + self.ff(self.norm(x))


class LM(nn.Module):
    def __init__(self, vocab=256, dim=16):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab, bias=False)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(2))

    def forward(self, input_ids):
        x = self.emb(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        if logits.is_meta or not self.training:  # a probe of the model, not a training step
            return logits
        if not hasattr(self, "calls"):
            self.calls = torch.zeros((), dtype=torch.int64, device=logits.device)
            self.bad_calls, self.bad_from = _bad_calls(logits.device)
        self.calls += 1
        bad = torch.isin(self.calls, self.bad_calls) | ((self.bad_from >= 0) & (self.calls >= self.bad_from))
        return logits * torch.where(bad, float("nan"), 1.0).to(logits.dtype)  # NaN gradients too


def build():
    return LM()
'''

RUN = ["+recipe=cpu_smoke", "model=custom", f"model.target={NAN_MODULE}:build",
       f"model.fsdp_unit_modules=[{NAN_MODULE}.Block]", "train.progress=false", "train.seq_len=16",
       "train.micro_batch_size=2", "train.grad_accum_steps=1", "data.max_bytes=200000", "optim.warmup_steps=0"]


@pytest.fixture(scope="module")
def nan_env(tmp_path_factory):
    return write_user_module(tmp_path_factory.mktemp("nan_code"), NAN_SOURCE, NAN_MODULE)


def weights(run_dir, step):
    from mfsdp_launch.checkpoint.weights import read_model_state

    return read_model_state(run_dir / "checkpoints" / f"step_{step}")[0]


def untimed(row: dict) -> dict:
    """A metrics row without what the clock decides (throughput, MFU, step time, memory)."""
    return {k: v for k, v in row.items() if not k.endswith(("_s", "_per_gpu", "_gib")) and not k.startswith("mfu")}


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["foreach", "fused"])
def test_bad_steps_on_one_rank_are_skipped_alike_then_rolled_back_and_never_saved(tmp_path, nan_env, monkeypatch,
                                                                                   impl):
    """As mfsdp-train's ranks run it (helpers.train_ranks; every rank must exit 0): what is proven
    happens in the ranks. The CLI's side (exit code 5, the console's lines) is the next test's.
    optim.impl=fused: torch's fused AdamW skips the bad steps on the device, FSDP2's DTensor
    shards reading the loop's flag (rank/loop.defers_verdict)."""
    run = tmp_path / "run"
    monkeypatch.syspath_prepend(nan_env["PYTHONPATH"].split(os.pathsep)[0])  # the launcher's checks build it here
    # Rank 1's forward is NaN at step 2, then at steps 5, 6, 7: three in a row roll back to step 4.
    # Log rows only every 5 steps: the bad steps are not log steps (they used to be committed).
    out = train_ranks(*RUN, f"run.dir={run}", "train.steps=9", "train.log_interval=4", "checkpoint.interval=1",
                      "checkpoint.keep_last=20", f"optim.impl={impl}", env={**nan_env, "NAN_CALLS": "2,5,6,7", "NAN_RANK": "1"})
    assert "step 2: loss nan, grad norm nan (non-finite loss on 1 rank(s)): skipped" in out, out
    assert "step 7: loss nan, grad norm nan (non-finite loss on 1 rank(s)): 3 bad steps in a row since step 5, " \
           "rolling back" in out
    assert "rolled back to step 4 (rollback 1 of train.max_rollbacks=2)" in out

    # Both ranks skipped step 2: the weights of both shards are those of step 1; step 3 trains on.
    w1, w2, w3 = (weights(run, s) for s in (1, 2, 3))
    assert same(w1, w2) and not same(w2, w3)
    # No committed checkpoint holds a non-finite weight (steps 5, 6 held step 4's, then were trained again).
    steps = sorted(int(p.name[5:]) for p in (run / "checkpoints").glob("step_*"))
    assert steps == list(range(1, 10))
    for s in steps:
        assert all(torch.isfinite(t).all() for t in weights(run, s).values()), s
    assert not same(weights(run, 4), weights(run, 5))  # step 5 trained again after the rollback

    rows = train_rows(run)
    assert rows[4]["skipped_steps"] == 1 and rows[4]["bad_steps"] == 0
    assert (rows[9]["skipped_steps"], rows[9]["rollbacks"], rows[9]["bad_steps"]) == (4, 1, 0)
    assert all(r["loss"] == r["loss"] for r in rows.values())  # finite: bad steps are not averaged in
    trainer = json.loads((run / "checkpoints" / "step_9" / "trainer.json").read_text())
    assert trainer["train_state"]["skipped_steps"] == 4 and trainer["train_state"]["rollbacks"] == 1


@pytest.mark.slow
def test_bad_steps_after_the_last_rollback_stop_the_run_with_one_line_and_exit_code_5(tmp_path, nan_env):
    from mfsdp_launch.core import exit_codes
    from mfsdp_launch.core.schema import DataConfig
    from mfsdp_launch.data import build_token_cache

    run, cache = tmp_path / "run", tmp_path / "cache"
    # The run's token cache, built here and damaged: one byte flipped, the size unchanged.
    cache_dir, _ = build_token_cache(DataConfig(name="text", max_bytes=200000, cache_dir=str(cache)))
    shard = Path(cache_dir) / "shard_000000.bin"
    good = shard.read_bytes()
    shard.write_bytes(good[:1000] + bytes([good[1000] ^ 1]) + good[1001:])
    # NaN from step 4 on: steps 4, 5 roll back to step 2 (step 4's save is inside the streak),
    # with the LR halved; steps 3, 4 are bad again and train.max_rollbacks=1 is spent.
    out = cli(*RUN, f"run.dir={run}", "train.steps=20", "train.log_interval=1", "checkpoint.interval=2",
              "train.max_bad_steps=2", "train.max_rollbacks=1", "train.rollback_lr_scale=0.5",
              "launcher.nproc_per_node=1", "mesh.dp_shard=1", f"data.cache_dir={cache}",
              env={**nan_env, "NAN_CALLS": "4-"}, timeout=300)
    assert out.returncode == exit_codes.DIVERGED == 5, out.stdout[-3000:] + out.stderr[-3000:]
    # The launcher rebuilt the cache: the rank found it intact (its log has no such warning).
    assert out.stderr.count(f"the token cache {cache_dir} was damaged ({shard} checksum") == 1, out.stderr
    assert shard.read_bytes() == good and "damaged" not in (run / "logs" / "rank0.stderr.log").read_text()
    assert "Traceback" not in out.stdout + out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("mfsdp-train: error:")]
    assert errors == ["mfsdp-train: error: training diverged at step 4: 2 bad steps in a row since step 3 "
                      "(loss nan, grad norm nan (non-finite loss on 1 rank(s))) after 1 rollback(s) "
                      "(train.max_rollbacks=1)"], out.stderr
    assert "rolled back to step 2 (rollback 1 of train.max_rollbacks=1); LR x0.5 from now on" in out.stdout
    assert "mfsdp-train: diverged at step" in out.stderr and "exit code 5" in out.stderr
    # The undone steps' rows are set aside, not lost; metrics.jsonl holds the one timeline.
    undone = [json.loads(line) for line in (run / "metrics.rolled_back.jsonl").read_text().splitlines()]
    assert [r["step"] for r in undone] == [3, 4]
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[2]["lr"] == rows[1]["lr"] * 0.5  # back at step 2's LR, halved
    for s in (2, 4):  # step 4's save held step 3's weights: intact and finite
        assert all(torch.isfinite(t).all() for t in weights(run, s).values())


@pytest.mark.slow
def test_verdicts_read_a_step_late_roll_back_as_the_host_verdicts_do(tmp_path, nan_env, monkeypatch):
    """optim.impl=fused reads each step's verdict during the next step; train.spike_zscore (never
    reached here) makes the loop read it before the optimizer step instead. Bad steps 5, 6, 7: the
    third is judged while step 8 runs, which is dropped, and both runs roll back to step 4 alike."""
    monkeypatch.syspath_prepend(nan_env["PYTHONPATH"].split(os.pathsep)[0])
    outs, finals, rows = [], [], []
    for name, extra in (("late", []), ("host", ["train.spike_zscore=1e9"])):
        run = tmp_path / name
        outs.append(train_ranks(*RUN, f"run.dir={run}", "train.steps=12", "train.log_interval=12",
                                "checkpoint.interval=4", "checkpoint.keep_last=20", "optim.impl=fused", *extra,
                                env={**nan_env, "NAN_CALLS": "5,6,7", "NAN_RANK": "1"}))
        finals.append(weights(run, 12))
        rows.append(untimed(train_rows(run)[12]))
    for out in outs:
        assert "step 7: loss nan, grad norm nan (non-finite loss on 1 rank(s)): 3 bad steps in a row since step 5, " \
               "rolling back" in out and "rolled back to step 4 (rollback 1 of train.max_rollbacks=2)" in out, out
    assert same(*finals)
    assert rows[0] == rows[1] and (rows[0]["skipped_steps"], rows[0]["rollbacks"]) == (3, 1), rows
