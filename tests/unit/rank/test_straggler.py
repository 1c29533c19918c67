"""The straggler report (rank/straggler.py): the ratio rule, and a real gloo all_gather in which a
rank that burns CPU time is named while a rank that only waits (as in a collective) is not."""

from __future__ import annotations

import time

from helpers import run_ranks
from mfsdp_launch.rank.straggler import median_without, stragglers


def test_a_rank_over_the_ratio_of_the_others_median_is_named():
    assert stragglers([1.0, 2.0], 1.5) == [1]  # of two ranks: against the other one
    assert stragglers([1.0, 1.4], 1.5) == []
    assert stragglers([1.0, 1.1, 0.9, 5.0, 1.0, 1.0, 4.0, 1.0], 1.5) == [3, 6]
    assert stragglers([0.0, 0.0], 1.5) == [] and stragglers([2.0] * 4, 1.5) == []
    assert median_without([1.0, 2.0, 3.0, 10.0], 3) == 2.0 and median_without([1.0, 2.0, 3.0, 10.0], 0) == 3.0


def busy_and_waiting(rank: int, world: int, ratio: str) -> None:
    import torch

    from mfsdp_launch.rank.straggler import StragglerReport

    report = StragglerReport(float(ratio), world, torch.device("cpu"))
    for _ in range(2):  # two log intervals of 3 steps
        if rank == 1:
            end = time.thread_time() + 0.3  # a slower rank: its own work takes longer
            while time.thread_time() < end:
                pass
        else:
            time.sleep(0.3)  # waiting for it, as inside a collective: no CPU time
        row = report.check(3)
        assert row["stragglers"] == [1] and row["slowest_rank"] == 1, row
        assert row["step_busy_max_s"] >= 0.09, row


def test_a_busy_rank_is_named_and_a_waiting_one_is_not_over_gloo():
    run_ranks(busy_and_waiting, 2, "1.5")


def test_ratio_0_or_one_rank_is_off():
    import torch

    from mfsdp_launch.core.schema import TrainConfig
    from mfsdp_launch.rank.straggler import build

    cpu = torch.device("cpu")
    assert build(TrainConfig(straggler_ratio=0), 8, cpu) is None and build(TrainConfig(), 1, cpu) is None
    assert build(TrainConfig(), 2, cpu).ratio == 1.5
