"""scripts/bench_report.py: issue 16's now/after table picks the right rows."""

from __future__ import annotations

import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import bench_report  # noqa: E402


def _row(name, tps, **kw):
    return dict(dict(name=name, ok=True, tokens_per_s_per_gpu=tps, mfu=tps / 20000, kind="launcher"), **kw)


def test_after_is_the_best_comparable_row():
    te8b = dict(model="te_gpt", preset="8b", seq=8192, precision="delayed")
    runs = {r["name"]: r for r in [
        _row("a_ga8", 13800, ga=8, **te8b),
        _row("b_ga16", 14100, ga=16, **te8b),
        _row("c_tp2", 16000, ga=8, tp=2, **te8b),  # another layout: not the workload
        _row("c_l8_1gpu", 30000, ga=8, n_layers=8, world=1, **te8b),  # a slice of the model on one GPU
        _row("d_ga1", 12700, **te8b),
        _row("e_failed", 20000, ga=8, **dict(te8b, ok=False)),
    ]}
    table = {line.split(" | ")[0].lstrip("| "): line for line in bench_report.goal_table(runs) if line.startswith("| ")}
    assert "`b_ga16`" in table["te_gpt 8b FP8, dp_shard=2, seq 8192, mbs 1, grad_accum >= 8"]
    assert "`d_ga1`" in table["same, grad_accum 1"]
    assert "not measured" in table["gpt 8b bf16, seq 4096, mbs 1"]
    assert len(table) == len(bench_report.GOALS) + 1  # + the header row
