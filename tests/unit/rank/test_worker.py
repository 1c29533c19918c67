"""The worker's wiring pieces that need no process group."""

import pytest
import torch

from helpers import one_rank_group, read_metrics
from mfsdp_launch.planner import prepare
from mfsdp_launch.planner.compose import compose
from mfsdp_launch.data import TokenBatches
from mfsdp_launch.rank.loop import TrainState
from mfsdp_launch.mesh import ParallelDims
from mfsdp_launch.models import build_model_spec
from mfsdp_launch.rank.runtime import Runtime, batch_source


def _batch_source(cfg, spec, dims, rank, device, resumed=None):
    rt = Runtime(rank=rank, local_rank=0, world_size=dims.world_size, device=device, control=None, dims=dims,
                 mesh=None)
    return batch_source(cfg, spec, rt, resumed)


def _cfg(tmp_path, *overrides):
    cfg, _ = prepare(["model.preset=tiny", "data=synthetic", "train.seq_len=16", "train.micro_batch_size=2",
                      f"data.cache_dir={tmp_path}", *overrides])
    return cfg


def test_resume_at_another_dp_size_continues_with_the_next_unseen_sample(tmp_path):
    # Saved at step 3 by 2 ranks x 2 samples x 2 microbatches: 24 samples consumed.
    cfg = _cfg(tmp_path, "train.grad_accum_steps=2")
    spec = build_model_spec(cfg.model, cfg.train.seq_len)
    one_rank = ParallelDims(1, 1, 1, 1)
    resumed = TrainState(step=3, tokens_seen=24 * 16, consumed_samples=24)
    next_batch = _batch_source(cfg, spec, one_rank, 0, torch.device("cpu"), resumed=resumed)
    reference = TokenBatches(cfg.data, seq_len=16, micro_batch_size=2, vocab_size=256, seed=cfg.train.seed)
    assert torch.equal(next_batch(3, 0)["input_ids"], reference.batch(24)["input_ids"])
    assert torch.equal(next_batch(3, 1)["input_ids"], reference.batch(26)["input_ids"])
    assert torch.equal(next_batch(4, 0)["input_ids"], reference.batch(28)["input_ids"])


def test_fresh_start_uses_the_plain_layout(tmp_path):
    cfg = _cfg(tmp_path)
    spec = build_model_spec(cfg.model, cfg.train.seq_len)
    dims = ParallelDims(1, 2, 1, 1)
    next_batch = _batch_source(cfg, spec, dims, 1, torch.device("cpu"))
    reference = TokenBatches(cfg.data, seq_len=16, micro_batch_size=2, vocab_size=256, seed=cfg.train.seed)
    assert torch.equal(next_batch(5, 0)["input_ids"], reference.batch(5 * 4 + 2)["input_ids"])


def test_toys_train_on_a_fixed_pair_per_dp_rank(tmp_path):
    cfg = compose(["model=toy_cnn", "data=synthetic"])
    spec = build_model_spec(cfg.model, cfg.train.seq_len)
    dims = ParallelDims(1, 2, 1, 1)
    a0 = _batch_source(cfg, spec, dims, 0, torch.device("cpu"))
    a1 = _batch_source(cfg, spec, dims, 1, torch.device("cpu"))
    assert torch.equal(a0(0, 0)["x"], a0(7, 0)["x"])
    assert not torch.equal(a0(0, 0)["x"], a1(0, 0)["x"])


def test_logged_lr_is_a_number_when_the_optimizer_keeps_it_on_device(tmp_path):
    """Capturable FusedAdam (full-iteration CUDA graphs) holds the LR as a tensor; the metrics
    row must still be JSON (a tensor there crashed rank 0 alone and hung the job)."""
    import types

    from mfsdp_launch.rank.loop import _log_row
    from mfsdp_launch.components.metrics import MetricsWriter
    from mfsdp_launch.components.optim import build_scheduler
    from mfsdp_launch.core.schema import OptimConfig

    param = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([param], lr=3e-4)
    opt.param_groups[0]["lr"] = torch.tensor(3e-4)
    sched = build_scheduler(opt, OptimConfig(lr=3e-4, warmup_steps=2), 10)
    for _ in range(3):
        opt.step()
        sched.step()
    assert torch.is_tensor(opt.param_groups[0]["lr"])
    ctx = types.SimpleNamespace(world_size=1, spec=types.SimpleNamespace(flops_per_token=None), peak_tflops=None,
                                precision_peak_tflops=None, optimizer=opt, device=torch.device("cpu"))
    with one_rank_group(tmp_path / "store"):
        row = _log_row(ctx, TrainState(step=3), 5.0, 1.0, 0.1, 4096, 0.0)  # (mean loss and norm: check_step's floats)
    writer = MetricsWriter(tmp_path, enabled=True)
    writer.write(row)
    writer.close()
    (logged,) = read_metrics(tmp_path)
    assert logged["lr"] == pytest.approx(float(opt.param_groups[0]["lr"]))


def test_a_failing_rank_prints_its_traceback_and_exits_without_teardown():
    """A rank that raises mid-training reports the error and exits 1 at once; it does not wait
    in NCCL teardown for peers (or live CUDA graphs), so torchrun can stop the job."""
    import os
    import subprocess
    import sys

    code = (
        "import mfsdp_launch.rank.worker as w\n"
        "def fail(cfg):\n"
        "    raise RuntimeError('injected failure at step 10')\n"
        "w._train = fail\n"
        "w.run(None)\n"
        "print('returned normally')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["RANK"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 1, proc.stderr
    assert "rank 1 failed" in proc.stderr
    assert "injected failure at step 10" in proc.stderr and "Traceback" in proc.stderr
    assert "returned normally" not in proc.stdout
