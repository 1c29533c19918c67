"""Every combination the seed's `test_fully_shard` and `test_dcp_checkpoint_save_and_load` run is
accepted by a dry run on 8 processes; every combination the seed skips is refused in one line.

The seed is Megatron-FSDP's own test (shared/seed). Its model names map onto ours; its
`dp_outer_strategy=None` (no outer dim passed) is our HSDP default `no_shard`.
"""

from __future__ import annotations

from itertools import product

import pytest

from helpers import cli, refused
from mfsdp_launch.planner import prepare

MODELS = {"cnn": "toy_cnn", "transformer": "toy_transformer", "te_transformer": "te_toy_transformer"}
ZERO = ("no_shard", "optim", "optim_grads", "optim_grads_params")
DRY_RUN_8 = ["engine=megatron_fsdp", "launcher.nproc_per_node=8", "launcher.dry_run=true", "data=synthetic"]


def mesh(shape):
    return [f"mesh.{k}={v}" for k, v in zip(("dp_outer", "dp_shard", "cp", "tp"), shape)]


def fully_shard_cases():
    """(id, overrides, the seed's skip reason or None) of test_fully_shard's parametrization."""
    commons = {"meta_fp32_compile": ["model.init_on_meta=true", "precision.main_params_dtype=fp32", "train.compile=true"],
               "plain": ["model.init_on_meta=false", "precision.main_params_dtype=null", "train.compile=false"]}
    for model, zero, outer, shape, common in product(MODELS, ZERO, (None, "no_shard", "optim"),
                                                      ((2, 2, 2, 1), (1, 2, 2, 2), (2, 2, 1, 2)), commons):
        # The seed's skip conditions; where both hold, either key may be named.
        skip = tuple(key for key, cond in (("model.init_on_meta", common == "meta_fp32_compile" and zero == "no_shard"),
                                           ("sharding.outer_dp_sharding_strategy",
                                            outer == "optim" and zero != "optim_grads_params")) if cond)
        overrides = [f"model={MODELS[model]}", "model.dim=2", "model.n_layers=2", f"sharding.zero_dp_strategy={zero}",
                     f"sharding.outer_dp_sharding_strategy={outer or 'no_shard'}", *mesh(shape), *commons[common],
                     "precision.main_grads_dtype=null", "engine.report_nan_in_param_grad=true"]
        yield f"fully_shard-{model}-{zero}-{outer}-{shape}-{common}", overrides, skip


def dcp_cases():
    for shape, zero, outer, model in product(((1, 4, 2, 1), (2, 2, 2, 1)), ZERO, ("no_shard", "optim"), MODELS):
        skip = ("sharding.outer_dp_sharding_strategy",) if outer == "optim" and zero != "optim_grads_params" else ()
        # The seed xfails no_shard checkpointing (unsupported upstream); the launcher saves it as
        # replicated tensors, so it is accepted here.
        overrides = [f"model={MODELS[model]}", "model.dim=2", f"sharding.zero_dp_strategy={zero}",
                     f"sharding.outer_dp_sharding_strategy={outer}", *mesh(shape), "precision.main_params_dtype=fp32",
                     "precision.main_grads_dtype=fp32", "engine.sync_every_microbatch=true", "checkpoint.interval=1"]
        yield f"dcp-{model}-{zero}-{outer}-{shape}", overrides, skip


CASES = list(fully_shard_cases()) + list(dcp_cases())


def test_the_matrix_is_the_seeds():
    assert len(list(fully_shard_cases())) == 3 * 4 * 3 * 3 * 2  # 216, as the seed parametrizes
    assert len(list(dcp_cases())) == 2 * 4 * 2 * 3  # 48
    skipped = [c for c in CASES if c[2]]
    # fully_shard: meta + no_shard (3 models x 3 outer x 3 meshes = 27), outer optim without ZeRO-3
    # (the other 45 of its 3 x 3 x 3 x 2 cases); dcp: outer optim without ZeRO-3 (2 x 3 x 3 = 18).
    assert len(skipped) == 27 + 45 + 18


@pytest.mark.parametrize("case_id,overrides,skip", CASES, ids=[c[0] for c in CASES])
def test_seed_combination(case_id, overrides, skip):
    if not skip:
        cfg, warnings = prepare(DRY_RUN_8 + overrides, check_hardware=False)
        assert cfg.mesh.dp_outer * cfg.mesh.dp_shard * cfg.mesh.cp * cfg.mesh.tp == 8
        if "sharding.outer_dp_sharding_strategy=optim" in overrides and "mesh.dp_outer=1" in overrides:
            assert any("outer dimension has one rank" in w for w in warnings)
    else:
        e = refused(*DRY_RUN_8, *overrides)
        assert e.key in skip and "\n" not in str(e)


@pytest.mark.parametrize("case_id", ["fully_shard-cnn-optim_grads_params-optim-(1, 2, 2, 2)-meta_fp32_compile",
                                     "fully_shard-te_transformer-no_shard-None-(2, 2, 1, 2)-meta_fp32_compile"])
def test_seed_combination_through_the_cli(case_id, tmp_path):
    """The same answers from `mfsdp-train ... launcher.dry_run=true`, as a user types it."""
    _, overrides, skip = next(c for c in CASES if c[0] == case_id)
    r = cli(*DRY_RUN_8, *overrides, f"run.dir={tmp_path / 'run'}")
    if not skip:
        assert r.returncode == 0, r.stderr
        assert "mesh (dp_outer, dp_shard, cp, tp) = (1, 2, 2, 2)" in r.stdout
    else:
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith(f"mfsdp-train: error: {skip[0]}:")
    assert not (tmp_path / "run").exists()
