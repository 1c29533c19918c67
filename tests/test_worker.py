"""The worker's wiring pieces that need no process group."""

import torch

from mfsdp_launch.compose import compose
from mfsdp_launch.data import TokenBatches
from mfsdp_launch.loop import TrainState
from mfsdp_launch.mesh import ParallelDims
from mfsdp_launch.models import build_model_spec
from mfsdp_launch.validate import validate
from mfsdp_launch.worker import _batch_source


def _cfg(tmp_path, *overrides):
    cfg = compose(["model.preset=tiny", "data=synthetic", "train.seq_len=16", "train.micro_batch_size=2",
                   f"data.cache_dir={tmp_path}", *overrides])
    validate(cfg)
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
