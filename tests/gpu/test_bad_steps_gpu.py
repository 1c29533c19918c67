"""Bad steps on one GPU under Megatron-FSDP, through the CLI: torch's fused AdamW (the CUDA default)
skips a non-finite step on the device, so the loop reads each verdict a step late
(rank/loop.defers_verdict) and never waits for the GPU before the optimizer step; the weights
across a skipped step stay as they were, and a rollback judged during the next step ends where the
host's verdicts (train.spike_zscore needs them first) end, to the bit; the same under a
full-iteration CUDA graph, where it also ends where the un-graphed run does."""

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


def test_bad_steps_under_a_full_iteration_graph_are_read_late_and_rolled_back(tmp_path):
    """train.cuda_graph=full_iteration with torch's fused AdamW reads each verdict a step late, as
    the un-graphed step does: step 2 skipped, steps 6-8 rolled back to step 5 during step 9 (a
    replay already queued; its gradients zeroed, the graph's views kept), and the run ends with the
    weights of host verdicts under the same graph (to the bit) and of the un-graphed run."""
    require_gpus(1)
    import inspect

    from e2e.test_bad_steps_e2e import NAN_MODULE, NAN_SOURCE, RUN, same, untimed, weights
    from helpers import cli, train_rows, write_user_module
    from mfsdp_launch.components.cuda_graph import FullIterationCudaGraph

    # the model counts its calls on the device (a replay runs no Python); the graph's warm-up
    # iterations call it before step 1
    warmup = inspect.signature(FullIterationCudaGraph).parameters["warmup_iters"].default
    env = write_user_module(tmp_path / "code", NAN_SOURCE, NAN_MODULE)
    bad_steps = (2, 6, 7, 8)
    finals, rows = {}, {}
    for name, graph, extra in (("eager", False, []), ("graph_late", True, []),
                               ("graph_host", True, ["train.spike_zscore=1e9"])):
        run = tmp_path / name
        calls = ",".join(str(s + (warmup if graph else 0)) for s in bad_steps)
        out = cli(*RUN, f"run.dir={run}", "engine=megatron_fsdp", "launcher.nproc_per_node=1",
                  "mesh.dp_shard=1", "train.steps=12", "train.log_interval=12", "checkpoint.interval=1",
                  "checkpoint.keep_last=20", "optim.impl=fused", "precision.main_grads_dtype=fp32",  # a graph's rule
                  *(["train.cuda_graph=full_iteration"] if graph else []),
                  *extra, env={**env, "NAN_CALLS": calls, "CUDA_VISIBLE_DEVICES": "0"}, timeout=400)
        text = out.stdout + out.stderr
        assert out.returncode == 0, text[-3000:]
        assert "step 2: loss nan, grad norm nan" in text and "rolled back to step 5" in text, text[-3000:]
        assert ("train.cuda_graph: full_iteration: step 1 captured" in text) is graph, text[-3000:]
        assert same(weights(run, 1), weights(run, 2)) and not same(weights(run, 2), weights(run, 3))
        finals[name] = weights(run, 12)
        rows[name] = untimed(train_rows(run)[12])
        print(f"{name}: step 12 row {rows[name]}")
    assert same(finals["graph_late"], finals["graph_host"]) and rows["graph_late"] == rows["graph_host"]
    assert (rows["graph_late"]["skipped_steps"], rows["graph_late"]["rollbacks"]) == (4, 1)
    worst = max(((finals["graph_late"][k] - v).abs().max() / v.abs().max().clamp_min(1e-12)).item()
                for k, v in finals["eager"].items())  # fp32 weights
    print(f"graph vs eager: max relative weight difference at step 12: {worst:.2e}")
    assert worst <= 1e-6
