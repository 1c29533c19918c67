"""Bad steps on one GPU under Megatron-FSDP, through the CLI: torch's fused AdamW (the CUDA default)
skips a non-finite step on the device, so the loop reads each verdict a step late
(rank/loop.defers_verdict) and never waits for the GPU before the optimizer step; the weights
across a skipped step stay as they were, and a rollback judged during the next step ends where the
host's verdicts (train.spike_zscore needs them first) end, to the bit."""

from __future__ import annotations

import pytest

from _harness import require_gpus

pytestmark = [pytest.mark.gpu]


def test_bad_steps_are_skipped_on_the_device_under_megatron_fsdp(tmp_path):
    require_gpus(1)
    from e2e.test_bad_steps_e2e import NAN_MODULE, NAN_SOURCE, RUN, same, untimed, weights
    from helpers import cli, train_rows, write_user_module

    env = write_user_module(tmp_path / "code", NAN_SOURCE, NAN_MODULE)
    finals, rows = [], []
    for name, extra in (("late", []), ("host", ["train.spike_zscore=1e9"])):
        run = tmp_path / name
        out = cli(*RUN, f"run.dir={run}", "engine=megatron_fsdp", "launcher.nproc_per_node=1", "mesh.dp_shard=1",
                  "train.steps=12", "train.log_interval=12", "checkpoint.interval=1", "checkpoint.keep_last=20",
                  "optim.impl=fused", *extra, env={**env, "NAN_CALLS": "2,6,7,8", "CUDA_VISIBLE_DEVICES": "0"},
                  timeout=400)
        text = out.stdout + out.stderr
        assert out.returncode == 0, text[-3000:]
        assert "step 2: loss nan, grad norm nan" in text and "rolled back to step 5" in text, text[-3000:]
        assert same(weights(run, 1), weights(run, 2)) and not same(weights(run, 2), weights(run, 3))
        finals.append(weights(run, 12))
        rows.append(untimed(train_rows(run)[12]))
        print(f"{name}: step 12 row {rows[-1]}")
    assert same(*finals) and rows[0] == rows[1] and (rows[0]["skipped_steps"], rows[0]["rollbacks"]) == (4, 1)
