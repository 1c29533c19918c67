"""metrics.tail.json (components/metrics_tail.py): a torn last line of metrics.jsonl is cut back
and its rows written again from the tail, up to the resumed step; nothing else is touched."""

from __future__ import annotations

import json

from mfsdp_launch.components.metrics_tail import MetricsTail
from mfsdp_launch.core import rundir


def rows(n):
    return [{"step": s, "loss": 10.0 / s} for s in range(1, n + 1)]


def written(tmp_path, rs, cut: int = 0):
    text = "".join(json.dumps(r) + "\n" for r in rs)
    (tmp_path / rundir.METRICS).write_text(text[: len(text) - cut] if cut else text)
    tail = MetricsTail(tmp_path)
    for r in rs:
        tail.add(r)
    return MetricsTail(tmp_path)  # as a resumed rank 0 reads it


def steps(tmp_path):
    return [json.loads(line)["step"] for line in (tmp_path / rundir.METRICS).read_text().splitlines()]


def test_a_row_cut_mid_line_is_written_again_from_the_tail(tmp_path):
    tail = written(tmp_path, rows(6), cut=20)
    assert tail.repair(tmp_path / rundir.METRICS, up_to_step=6) == [6]
    assert steps(tmp_path) == [1, 2, 3, 4, 5, 6]


def test_only_rows_up_to_the_resumed_step_come_back(tmp_path):
    rs = rows(6)
    cut = len(json.dumps(rs[-1])) + 1 + len(json.dumps(rs[-2])) // 2
    tail = written(tmp_path, rs, cut=cut)  # row 6 gone, row 5 cut mid-line; the checkpoint is at 5
    assert tail.repair(tmp_path / rundir.METRICS, up_to_step=5) == [5]
    assert steps(tmp_path) == [1, 2, 3, 4, 5]


def test_an_intact_file_or_a_missing_newline_only_is_kept(tmp_path):
    tail = written(tmp_path, rows(3))
    before = (tmp_path / rundir.METRICS).read_text()
    assert tail.repair(tmp_path / rundir.METRICS, up_to_step=3) == [] and (tmp_path / rundir.METRICS).read_text() == before
    tail = written(tmp_path, rows(3), cut=1)
    assert tail.repair(tmp_path / rundir.METRICS, up_to_step=3) == [] and (tmp_path / rundir.METRICS).read_text() == before


def test_a_step_written_again_replaces_the_later_rows_of_the_tail(tmp_path):
    tail = MetricsTail(tmp_path)
    for r in rows(5) + [{"step": 3, "loss": 0.5}]:  # a rollback to step 2 wrote step 3 again
        tail.add(r)
    assert [r["step"] for r in MetricsTail(tmp_path).rows] == [1, 2, 3] and tail.rows[-1]["loss"] == 0.5
