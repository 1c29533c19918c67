"""Data-parallel layouts, ZeRO levels, gradient accumulation, meta init, frozen parameters and the
seed's toys, trained as mfsdp-train's ranks (helpers.train_ranks: gloo, real FSDP2, the real loop):
every layout of one global batch gives the curve of one rank holding all of it. The CLI around the
same ranks is proven in tests/e2e/test_train_e2e.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import read_metrics, train_ranks

# A tiny GPT on short sequences of a small slice of the stdlib's text (sample g is read by its
# global index, so every layout sees the same global batch), fp32, a row every step.
BASE = ["engine=fsdp2", "model=gpt", "model.preset=tiny", "data=text", "data.max_bytes=2000000", "train.seq_len=32",
        "train.log_interval=1", "train.progress=false", "optim.warmup_steps=0", "optim.lr=1e-2",
        "checkpoint.save_final=false", "checkpoint.interval_minutes=null", "train.grad_clip=null", "train.steps=4"]

# name -> (ranks, overrides); 8 samples a step in every layout.
LAYOUTS = {
    "hsdp": (4, ["mesh.dp_outer=2", "mesh.dp_shard=2", "train.micro_batch_size=2"]),
    "accumulation": (2, ["train.micro_batch_size=2", "train.grad_accum_steps=2"]),
    "accumulation_sync_every_micro": (2, ["train.micro_batch_size=2", "train.grad_accum_steps=2",
                                          "engine.sync_every_microbatch=true"]),
    "zero2": (2, ["train.micro_batch_size=4", "sharding.zero_dp_strategy=optim_grads"]),
    "no_shard": (2, ["train.micro_batch_size=4", "sharding.zero_dp_strategy=no_shard"]),
}


# The seed's toys as the seed trains them: synthetic data, 8 steps.
TOYS = ["engine=fsdp2", "data=synthetic", "train.log_interval=1", "train.progress=false", "optim.lr=1e-2",
        "optim.warmup_steps=0", "optim.weight_decay=0", "checkpoint.save_final=false",
        "checkpoint.interval_minutes=null", "train.steps=8"]


def _train(ranks: int, run_dir: Path, *overrides: str) -> None:
    """`overrides` (BASE unless they name a toy) on `ranks` ranks in run_dir."""
    base = TOYS if any(o.startswith("model=toy") for o in overrides) else BASE
    train_ranks(*base, f"launcher.nproc_per_node={ranks}", f"run.dir={run_dir}", *overrides)


def _curve(run_dir: Path):
    return [r["loss"] for r in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The curve every layout below must reproduce: 1 rank, all 8 samples a step."""
    run_dir = tmp_path_factory.mktemp("reference") / "one"
    _train(1, run_dir, "train.micro_batch_size=8")
    one = _curve(run_dir)
    assert len(one) == 4 and one[-1] < one[0]  # it learns: otherwise equality would prove little
    return one


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_gives_the_one_rank_curve(tmp_path, reference, name):
    """HSDP (dp_outer=2 x dp_shard=2), accumulation syncing at the last micro-batch or every one,
    ZeRO-2 and no sharding (ZeRO-3, the default, is the accumulation case)."""
    ranks, overrides = LAYOUTS[name]
    _train(ranks, tmp_path / name, *overrides)
    assert _curve(tmp_path / name) == pytest.approx(reference, rel=1e-4, abs=1e-5)


def test_meta_init_and_the_seed_toys_learn(tmp_path):
    for name, overrides in (("meta", ["train.micro_batch_size=4", "model.init_on_meta=true", "train.steps=6"]),
                            ("toy_cnn", ["model=toy_cnn"]), ("toy_transformer", ["model=toy_transformer"])):
        _train(2, tmp_path / name, *overrides)
        losses = _curve(tmp_path / name)
        assert losses[-1] < losses[0], (name, losses)


def test_frozen_parameters_do_not_move(tmp_path):
    """Frozen embeddings equal their seeded init after training on 2 ranks; the rest moved."""
    import torch

    from mfsdp_launch.models import build_model_spec
    from mfsdp_launch.planner import prepare
    from mfsdp_launch.tools.export import export

    run_dir = tmp_path / "frozen"
    overrides = ["train.micro_batch_size=4", "model.freeze=[tok_emb.*]", "checkpoint.save_final=true"]
    _train(2, run_dir, *overrides)
    export(run_dir, tmp_path / "w.pt", fmt="torch")
    trained = torch.load(tmp_path / "w.pt")
    cfg, _ = prepare([*BASE, *overrides, f"run.dir={run_dir}"], check_hardware=False)
    torch.manual_seed(cfg.train.seed)  # the worker seeds like this before building
    initial = build_model_spec(cfg.model, cfg.train.seq_len).build().state_dict()
    assert torch.equal(trained["tok_emb.weight"], initial["tok_emb.weight"])
    moved = [k for k in initial if not k.startswith("tok_emb") and not torch.equal(trained[k], initial[k])]
    assert moved, "nothing trained"


def test_units_nested_in_units_shard_bottom_up_and_give_the_curve(tmp_path, reference):
    """Linear layers as FSDP2 units inside Block units (te_gpt's shape: its attention proj te.Linear
    sits in its TransformerLayer): wrapped parent first, a nested weight would become a DTensor
    twice over and reach the forward as one (the mixed Tensor/DTensor error here; a null pointer
    in TE's GEMM on a GPU). Bottom-up, 2 ranks give the one-rank curve."""
    units = "model.fsdp_unit_modules=[mfsdp_launch.models.llama.gpt_modules.Block,torch.nn.Linear]"
    _train(2, tmp_path / "nested", "train.micro_batch_size=4", units)
    assert _curve(tmp_path / "nested") == pytest.approx(reference, rel=1e-4, abs=1e-5)
