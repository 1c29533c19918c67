"""Tensor + sequence parallelism for `gpt` under FSDP2 on gloo (models/llama/tensor_parallel.py): the tp=2
loss curve equals tp=1's, DCP checkpoints reshard between tp=2 and tp=1 in both directions (one
tp=2 x dp=2 run proves the curve and saves the checkpoint the reshards start from), and
inside a tp=2 model the blocks hold T/2 tokens while logits and every gradient equal the plain
model's (two gloo ranks, helpers.run_ranks)."""

import pytest

from helpers import run_ranks, train_ranks, train_rows

# decay_steps pins the LR schedule, so a 10-step run followed by a resume to 20 equals one 20-step run.
BASE = ["engine=fsdp2", "model=gpt", "model.preset=tiny", "data=synthetic", "train.seq_len=32",
        "train.log_interval=1", "train.progress=false", "optim.warmup_steps=0", "optim.lr=3e-3",
        "optim.decay_steps=20", "train.micro_batch_size=4"]
ONE = ["launcher.nproc_per_node=1"]
TP2 = ["launcher.nproc_per_node=2", "mesh.tp=2"]


def run(run_dir, *overrides, steps=20, save=False):
    """The ranks of `mfsdp-train` (helpers.train_ranks); returns rank 0's output."""
    return train_ranks(*BASE, f"run.dir={run_dir}", f"train.steps={steps}",
                       f"checkpoint.save_final={str(save).lower()}", *overrides)


def assert_same_curve(a, b, steps):
    for step in steps:
        assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=2e-4), step
        assert b[step]["grad_norm"] == pytest.approx(a[step]["grad_norm"], rel=2e-3), step


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("tp") / "one"
    run(path, *ONE)
    return train_rows(path)


@pytest.mark.slow
def test_tp2_with_dp2_on_4_ranks_matches_tp1_and_its_checkpoint_reshards_to_tp1_and_back(tmp_path, reference):
    """One tp=2 x dp=2 run of 20 steps on 4 ranks equals the tp=1 curve and saves at step 7; a copy
    of that step 7 resumed in one run dir gives steps 8-14 at tp=1 (1 rank) and 15-20 at tp=2 again
    (2 ranks), both on the reference's curve."""
    import shutil

    run(tmp_path / "tp2", "launcher.nproc_per_node=4", "mesh.tp=2", "train.micro_batch_size=2",
        "checkpoint.interval=7")
    tp2 = train_rows(tmp_path / "tp2")
    assert sorted(tp2) == list(range(1, 21))
    assert len({r["loss"] for r in tp2.values()}) > 10  # the weights move
    assert tp2[1]["grad_norm"] == pytest.approx(reference[1]["grad_norm"], rel=1e-5)
    assert_same_curve(reference, tp2, range(1, 21))

    resumed = tmp_path / "run"
    shutil.copytree(tmp_path / "tp2" / "checkpoints" / "step_7", resumed / "checkpoints" / "step_7")
    for overrides, steps, start in ((ONE, 14, 7), (TP2, 20, 14)):
        out = run(resumed, *overrides, steps=steps, save=True)
        assert f"resuming from step {start}" in out, out[-3000:]
    assert sorted(train_rows(resumed)) == list(range(8, 21))
    assert_same_curve(reference, train_rows(resumed), range(8, 21))


def _sp_child(rank: int, world: int) -> None:
    """tp=2 over two gloo ranks vs the plain model from the same seed, same batch (doc mask too)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from mfsdp_launch.models.llama.gpt_modules import GPT
    from mfsdp_launch.models.llama.dims import GPTDims
    from mfsdp_launch.models.llama.tensor_parallel import parallelize_gpt

    torch.manual_seed(0)
    dims = GPTDims(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, vocab_size=64, norm_eps=1e-5,
                   rope_theta=10000.0, tie_embeddings=False)
    ref, model = GPT(dims), GPT(dims)
    model.load_state_dict(ref.state_dict())
    parallelize_gpt(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    seen = []
    model.layers[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
    ids = torch.randint(0, 64, (2, 16))
    doc_ids = torch.cat([torch.zeros(2, 5), torch.ones(2, 11)], dim=1).long()
    for kwargs in ({}, {"doc_ids": doc_ids}):
        ref.zero_grad(), model.zero_grad()
        out, want = model(ids, **kwargs), ref(ids, **kwargs)
        assert torch.allclose(out, want, atol=1e-5), (out - want).abs().max()
        out.square().mean().backward()
        want.square().mean().backward()
        grads = {n: p.grad for n, p in ref.named_parameters()}
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            assert torch.allclose(g, grads[name], atol=1e-6, rtol=1e-4), (name, (g - grads[name]).abs().max())
    assert seen[0] == (2, 8, 32), seen  # the residual stream holds T/tp tokens


def test_sequence_parallel_matches_the_plain_model():
    run_ranks(_sp_child, 2)
