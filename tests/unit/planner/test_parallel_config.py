"""TP/AC validation rules and the memory estimate and its pre-spawn check (torch-free parts)."""

import pytest

from helpers import refused
from mfsdp_launch.planner import prepare
from mfsdp_launch.core.errors import ConfigError
from mfsdp_launch.planner.memory import GIB, check_fits, estimate, parse_memory_total
from mfsdp_launch.mesh import ParallelDims

TP2 = ["engine=fsdp2", "mesh.tp=2", "launcher.nproc_per_node=2", "launcher.dry_run=true"]


def test_gpt_tp2_under_fsdp2_is_accepted():
    prepare(["model=gpt", *TP2], check_hardware=False)


@pytest.mark.parametrize("overrides,key,words", [
    (["model=gpt", "model.n_heads=8", "model.n_kv_heads=1", "model.dim=64"], "mesh.tp", "key/value heads"),
    (["model=gpt", "model.n_heads=2", "model.dim=64", "mesh.tp=4", "launcher.nproc_per_node=4"], "mesh.tp",
     "attention heads"),
    (["model=gpt", "engine=megatron_fsdp"], "mesh.tp", "redistributes its fused weights"),
    (["model=te_gpt"], "mesh.tp", "inside its TE layers"),
    (["model=toy_cnn"], "mesh.tp", "no tensor parallelism"),
    (["model=te_gpt", "mesh.tp=1", "mesh.cp=2"], "mesh.cp", "engine=megatron_fsdp only"),
    (["model=gpt", "model.activation_checkpointing=selective", "model.ac_every=0"], "model.ac_every", ">= 1"),
])
def test_refusals(overrides, key, words):
    e = refused(*TP2, *overrides)
    assert e.key == key and words in str(e), str(e)


def _estimate(*overrides):
    cfg, _ = prepare(["model=gpt", "model.preset=8b", "train.seq_len=4096", "train.micro_batch_size=2",
                   "precision.compute_dtype=bf16", "launcher.dry_run=true", *overrides], check_hardware=False)
    return estimate(cfg, ParallelDims.from_config(cfg.mesh, cfg.launcher.nproc_per_node))


def test_estimate_follows_tp_and_ac():
    base = _estimate("launcher.nproc_per_node=2", "mesh.dp_shard=1", "mesh.dp_outer=2",
                     "sharding.zero_dp_strategy=optim_grads_params")
    tp2 = _estimate(*TP2)
    full = _estimate("launcher.nproc_per_node=2", "model.activation_checkpointing=full")
    weights = lambda e: e.params + e.main_params  # noqa: E731 - FSDP2 keeps one copy, in main_params
    assert weights(tp2) < 0.6 * weights(base) and tp2.activations < base.activations
    assert full.activations < 0.4 * _estimate("launcher.nproc_per_node=2").activations


def test_check_fits_is_one_line_and_can_be_forced():
    assert check_fits(10 * GIB, 141 * GIB) is None
    assert check_fits(500 * GIB, None) is None  # no GPU here: nothing to compare
    with pytest.raises(ConfigError) as e:
        check_fits(150 * GIB, 140 * GIB)
    msg = str(e.value)
    assert "\n" not in msg and "needs ~150.0 GiB per GPU, the GPU has 140.0" in msg
    assert "model.activation_checkpointing=full, mesh.tp=2 or a smaller train.micro_batch_size" in msg
    assert "launcher.force_memory=true" in msg
    assert "needs ~150.0 GiB" in check_fits(150 * GIB, 140 * GIB, force=True)


def test_nvidia_smi_memory_total_parsing():
    assert parse_memory_total("143771\n143771\n") == 143771 * 1024**2
    assert parse_memory_total("81559\n40960\n") == 40960 * 1024**2
    assert parse_memory_total("[N/A]\n") is None and parse_memory_total("") is None
