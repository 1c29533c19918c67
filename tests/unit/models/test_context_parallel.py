"""Context parallelism for `gpt` (models/llama/context_parallel.py) on gloo: the attention op against
whole-sequence attention in real processes (values and gradients), RoPE at global positions, the
validation rules, and the CLI: cp=2 reproduces cp=1's losses, and a checkpoint saved at cp=2
resumes at cp=1 with the uninterrupted run's next losses (one cp=2 run proves both)."""

import os

import pytest
import torch
import torch.nn.functional as F

from helpers import refused, run_ranks, train_ranks, train_rows
from mfsdp_launch.planner import prepare
from mfsdp_launch.models import cp_layout
from mfsdp_launch.models.llama.gpt_modules import rope_cos_sin

# ---------------------------------------------------------------------------- the attention op

B, H, HKV, T, D = 2, 4, 2, 16, 8


def _reference(seed: int):
    """q/k/v for the whole sequence, whole-sequence causal GQA attention and its gradients."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, T, D, generator=gen, dtype=torch.float64) for h in (H, HKV, HKV))
    w = torch.randn(B, H, T, D, generator=gen, dtype=torch.float64)  # a loss that weights every output
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    y = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    (y * w).sum().backward()
    return (q, k, v), w, y.detach(), [t.grad for t in leaves]


def _attention_worker(rank: int, cp: int, out_dir: str) -> None:
    import torch.distributed as dist

    from mfsdp_launch.models.llama.context_parallel import ContextParallel

    (q, k, v), w, y_ref, grads_ref = _reference(seed=7)

    def shard(t):
        return cp_layout.shard_sequence(t, 2, rank, cp)

    leaves = [shard(t).clone().requires_grad_() for t in (q, k, v)]
    y = ContextParallel(dist.group.WORLD, rank, cp).attend(*leaves)
    (y * shard(w)).sum().backward()
    errors = [(y - shard(y_ref)).abs().max().item()]
    errors += [(leaf.grad - shard(g)).abs().max().item() for leaf, g in zip(leaves, grads_ref)]
    torch.save(errors, os.path.join(out_dir, f"rank{rank}.pt"))


def test_cp_attention_equals_whole_sequence_attention(tmp_path, cp=4):
    """Real gloo processes: outputs and q/k/v gradients (through the all-gather's reduce-scatter)
    are each rank's part of the whole-sequence ones, with grouped-query heads. cp=4 has inner
    chunks that neither start nor end the sequence (cp=2 runs in the CLI tests below)."""
    run_ranks(_attention_worker, cp, tmp_path)
    for rank in range(cp):
        errors = torch.load(tmp_path / f"rank{rank}.pt")
        assert max(errors) < 1e-12, (rank, errors)  # output, dq, dk, dv


def test_rope_at_positions_is_rows_of_the_whole_table():
    cos, sin = rope_cos_sin(32, 16, 10000.0, "cpu")
    pos = cp_layout.positions(32, 1, 4, device="cpu")  # chunks 1 and 6 of 8
    assert pos.tolist() == [4, 5, 6, 7, 24, 25, 26, 27]
    cos_p, sin_p = rope_cos_sin(pos, 16, 10000.0, "cpu")
    assert torch.equal(cos_p, cos[pos]) and torch.equal(sin_p, sin[pos])


# ---------------------------------------------------------------------------- validation

CP2 = ["mesh.cp=2", "launcher.nproc_per_node=2", "launcher.dry_run=true", "train.seq_len=64"]


@pytest.mark.parametrize("engine", ["fsdp2", "megatron_fsdp"])
def test_gpt_cp2_is_accepted(engine):
    prepare(["model=gpt", f"engine={engine}", *CP2], check_hardware=False)


def test_gpt_cp2_tp2_is_accepted():
    prepare(["model=gpt", "engine=fsdp2", *CP2, "mesh.tp=2", "launcher.nproc_per_node=4"], check_hardware=False)


@pytest.mark.parametrize("overrides,key,words", [
    (["model=te_gpt", "engine=fsdp2"], "mesh.cp", "engine=megatron_fsdp only"),
    (["model=gpt", "data=tokens", "data.doc_mask=true", "data.sources=[{path: x, weight: 1}]"], "data.doc_mask",
     "mesh.cp=2"),
    (["model=gpt", "train.seq_len=66"], "train.seq_len", "2*mesh.cp=4"),
])
def test_cp_refusals(overrides, key, words):
    err = refused(*CP2, *overrides)
    assert err.key == key and words in str(err), str(err)


# ---------------------------------------------------------------------------- the CLI, 2 gloo ranks

# fp32; decay_steps pins the LR schedule, so a run resumed at step 5 follows the 10-step one.
# Held-out text: validation batches are split over cp too.
BASE = ["engine=fsdp2", "model=gpt", "model.preset=tiny", "model.n_kv_heads=2", "data=text",
        "data.max_bytes=300000", "data.val_fraction=0.05", "train.val_interval=5", "train.val_steps=2",
        "train.seq_len=32", "train.micro_batch_size=4", "train.log_interval=1", "train.progress=false",
        "optim.warmup_steps=0", "optim.lr=3e-3", "optim.decay_steps=10"]
ONE = ["launcher.nproc_per_node=1"]
CP2_RUN = ["launcher.nproc_per_node=2", "mesh.cp=2"]


def run(run_dir, *overrides, steps=10, save=False):
    """The ranks of `mfsdp-train` (helpers.train_ranks); returns rank 0's output."""
    return train_ranks(*BASE, f"run.dir={run_dir}", f"train.steps={steps}",
                       f"checkpoint.save_final={str(save).lower()}", *overrides)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("cp") / "one"
    run(path, *ONE)
    return train_rows(path)


def assert_same(a, b, steps):
    for step in steps:
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5), step
        assert b[step]["grad_norm"] == pytest.approx(a[step]["grad_norm"], rel=1e-4), step


@pytest.mark.slow
def test_cp2_losses_equal_cp1_and_its_checkpoint_resumes_at_cp1(tmp_path, reference):
    """One cp=2 run of 10 steps, saving at step 5: its losses, grad norms and validation equal cp=1's;
    a copy of its step 5 checkpoint resumed at cp=1 (DCP reshards) gives the reference's steps 6-10."""
    import shutil

    run(tmp_path / "cp2", *CP2_RUN, "checkpoint.interval=5")
    cp2 = train_rows(tmp_path / "cp2")
    assert sorted(cp2) == list(range(1, 11))
    assert len({r["loss"] for r in cp2.values()}) > 5  # the weights move
    assert_same(reference, cp2, range(1, 11))
    for step in (5, 10):
        assert cp2[step]["val_loss"] == pytest.approx(reference[step]["val_loss"], rel=1e-5)

    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "cp2" / "checkpoints" / "step_5", resumed / "checkpoints" / "step_5")
    out = run(resumed, *ONE, steps=10)
    assert "resuming from step 5" in out, out[-3000:]
    assert sorted(train_rows(resumed)) == list(range(6, 11))
    assert_same(reference, train_rows(resumed), range(6, 11))


@pytest.mark.slow
def test_cp2_with_tp2_on_4_ranks_equals_cp1(tmp_path, reference):
    run(tmp_path / "cp2tp2", "launcher.nproc_per_node=4", "mesh.cp=2", "mesh.tp=2", steps=4)
    assert_same(reference, train_rows(tmp_path / "cp2tp2"), range(1, 5))
