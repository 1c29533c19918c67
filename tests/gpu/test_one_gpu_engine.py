"""One GPU: Megatron-FSDP at dp_shard=1 under every ZeRO level, in one job of one process
(_harness.py: the launcher's own build_model/build_engine/optimizer wiring, fresh NCCL world):
the seed's fully_shard (no gradients before the last microbatch, gradients after), DCP checkpoint
save/load, first updates equal plain AdamW (clipping included), Megatron-FSDP's own mesh
(mesh.enabled=false), frozen parameters and custom buffer dtypes (main params / main grads, with
grad_comm_dtype switched per step). The scenarios are test_megatron_fsdp.py's on the mesh
(1, 1, 1, 1); their checks are the same functions.

The first test also starts, in the background, the CLI runs that the tier's other modules read
(_one_gpu.py), so they run while this job does.
"""

from __future__ import annotations

import math

import pytest

import _one_gpu
from _harness import Job, case, outer_skip_reason, require_gpus
from test_megatron_fsdp import TOYS, ZEROS, _check_custom, _check_dcp, _check_fully_shard

pytestmark = pytest.mark.gpu

MESH = (1, 1, 1, 1)
JOB = Job("one_gpu_megatron_fsdp", 1, MESH, timeout=420)
# fp32main-meta: fp32 main weights, built on the meta device (refused with no_shard)
FS_VARIANTS = {"plain": dict(preserve_fp32=False, meta=False), "fp32main-meta": dict(preserve_fp32=True, meta=True)}
FS_CASES = [(m, z, v) for m in TOYS for z in ZEROS for v in FS_VARIANTS
            if not outer_skip_reason(z, "no_shard", MESH, meta=FS_VARIANTS[v]["meta"])]
CUSTOM = [(z, mp, mg) for z in ZEROS[1:] for mp in (None, "fp64") for mg in (None, "fp32")]

for _m, _z, _v in FS_CASES:
    JOB.add(f"fs-{_m}-{_z}-{_v}", "fully_shard", model=_m, zero=_z, outer="no_shard", compile=False,
            **FS_VARIANTS[_v])
for _m in TOYS:
    for _z in ZEROS:
        JOB.add(f"dcp-{_m}-{_z}", "dcp_roundtrip", model=_m, zero=_z, outer="no_shard")
for _z in ZEROS:
    JOB.add(f"adamw-{_z}", "adamw_equivalence", zero=_z)
    JOB.add(f"adamw-{_z}-bf16grads", "adamw_equivalence", zero=_z, main_grads="bf16")
    JOB.add(f"ez-{_z}", "ez", zero=_z)
for _meta in (False, True):
    JOB.add(f"frozen-meta{_meta}", "frozen", meta=_meta)
for _z, _mp, _mg in CUSTOM:
    JOB.add(f"custom-{_z}-{_mp}-{_mg}", "custom_dtype", model="toy_transformer", zero=_z, outer="no_shard",
            main_params=_mp, main_grads=_mg)


@pytest.fixture
def one_gpu(request):
    require_gpus(1)
    _one_gpu.start(request)  # the other modules' CLI runs in the background (under xdist: this file's, none)


@pytest.mark.parametrize("model,zero,variant", FS_CASES, ids=lambda v: str(v))
def test_fully_shard_one_gpu(one_gpu, model, zero, variant):
    _check_fully_shard(case(JOB, f"fs-{model}-{zero}-{variant}"))


@pytest.mark.parametrize("zero", ZEROS)
@pytest.mark.parametrize("model", TOYS)
def test_dcp_checkpoint_save_and_load_one_gpu(one_gpu, model, zero):
    _check_dcp(case(JOB, f"dcp-{model}-{zero}"), model, zero)


@pytest.mark.parametrize("zero", ZEROS)
def test_first_updates_equal_plain_adamw_one_gpu(one_gpu, zero):
    (d,) = case(JOB, f"adamw-{zero}")
    assert max(d["max_param_diff"]) < 2e-6, d["max_param_diff"]
    for n, r in zip(d["norm"], d["ref_norm"]):
        assert abs(n - r) <= 1e-5 * r, (d["norm"], d["ref_norm"])
    assert d["norm"][0] > d["clip"], "the clip threshold should have been exercised"
    for a, b in zip(d["loss"], d["ref_loss"]):
        assert abs(a - b) <= 1e-5 * b, (d["loss"], d["ref_loss"])
    assert d["loss"][-1] < d["loss"][0], d["loss"]
    assert d["scaling"] == ["None"], d["scaling"]  # one rank: no multiply by 1.0 before the reduce


@pytest.mark.parametrize("zero", ZEROS)
def test_bf16_main_gradients_are_not_multiplied_by_one_and_still_train_as_adamw_one_gpu(one_gpu, zero):
    """bf16 main gradients are the ones Megatron-FSDP multiplied by the 1/dp factor in place; on
    one rank the engine drops that factor (1.0). The updates still follow plain AdamW's to bf16's
    rounding of the gradients."""
    (d,) = case(JOB, f"adamw-{zero}-bf16grads")
    assert d["scaling"] == ["None"], d["scaling"]
    print(f"bf16 grads, {zero}: max param diff {max(d['max_param_diff']):.2e}, norms {d['norm']} vs {d['ref_norm']}")
    assert max(d["max_param_diff"]) < 1e-4, d["max_param_diff"]
    for n, r in zip(d["norm"], d["ref_norm"]):
        assert abs(n - r) <= 1e-2 * r, (d["norm"], d["ref_norm"])


@pytest.mark.parametrize("zero", ZEROS)
def test_fully_shard_ez_one_gpu(one_gpu, zero):
    """mesh.enabled=false: Megatron-FSDP builds its own (one-rank) mesh."""
    (d,) = case(JOB, f"ez-{zero}")
    assert len(d["losses"]) == 2 and all(math.isfinite(x) for x in d["losses"]), d


@pytest.mark.parametrize("meta", [False, True])
def test_model_with_frozen_param_one_gpu(one_gpu, meta):
    (d,) = case(JOB, f"frozen-meta{meta}")
    assert d["n_frozen"] > 0 and d["n_params_after"] == d["n_params"], d
    assert d["still_frozen"] and d["unchanged"] and not d["state_for_frozen"], d
    assert d["n_opt_params"] == d["trainable"] == d["n_params"] - d["n_frozen"], d
    assert all(math.isfinite(x) for x in d["losses"])


@pytest.mark.parametrize("zero,main_params,main_grads", CUSTOM, ids=str)
def test_fully_shard_custom_dtype_one_gpu(one_gpu, zero, main_params, main_grads):
    data = case(JOB, f"custom-{zero}-{main_params}-{main_grads}")
    _check_custom(data)
    if main_params is not None:  # a main weight buffer exists and has the asked dtype
        assert data[0]["main_weight_dtype"] == "torch.float64", data
