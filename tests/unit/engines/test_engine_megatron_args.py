"""The Megatron-FSDP engine's pure argument mapping (no CUDA, no process group)."""

import pytest
import torch
from omegaconf import OmegaConf

from mfsdp_launch.engines.megatron import MegatronFSDPEngine, make_capturable, match_capturable, reset_step_counters, unwrap
from mfsdp_launch.engines.megatron_grad_scaling import _restore_hfsdp_grad_scaling, _skip_unit_grad_scaling
from mfsdp_launch.engines.megatron_plan import plan_megatron_fsdp
from mfsdp_launch.core.errors import ConfigError
from mfsdp_launch.mesh import ParallelDims
from mfsdp_launch.core.schema import MeshConfig, PrecisionConfig, ShardingConfig
from mfsdp_launch.engines.config import MegatronFSDPConfig


def dims(dp_outer=1, dp_shard=-1, cp=1, tp=1, world=2):
    return ParallelDims.from_config(MeshConfig(dp_outer=dp_outer, dp_shard=dp_shard, cp=cp, tp=tp), world)


def typed(section, **values):
    """A config section typed the way composition types it (enum names or numbers accepted)."""
    return OmegaConf.merge(OmegaConf.structured(section), values)


def plan(d=None, zero=3, outer="no_shard", precision=None, engine=None, **kw):
    return plan_megatron_fsdp(d or dims(), typed(ShardingConfig, zero_dp_strategy=zero, outer_dp_sharding_strategy=outer),
                              precision or typed(PrecisionConfig), engine or MegatronFSDPConfig(name="megatron_fsdp"), **kw)


def test_plain_fsdp_dims_and_groups():
    p = plan(dims(dp_shard=2))
    assert (p.use_mesh, p.dp_shard_dim, p.dp_outer_dim, p.tp_dim) == (True, "dp_shard", None, "tp")
    assert p.hybrid_fsdp_group_dim is None
    assert p.zero_dp_strategy == "optim_grads_params" and p.outer_dp_sharding_strategy == "no_shard"
    assert p.grad_norm_group == "fsdp" and p.checkpoint_format == "dtensor"


def test_tp_dim_always_passed_even_of_size_one():
    assert plan(dims(dp_shard=2, tp=1)).tp_dim == "tp"
    assert plan(dims(dp_shard=1, tp=2)).tp_dim == "tp"


def test_cp_shards_over_flattened_dp_shard_cp():
    p = plan(dims(dp_shard=1, cp=2))
    assert p.dp_shard_dim == "dp_shard_cp"
    p8 = plan(dims(dp_outer=2, dp_shard=2, cp=2, world=8))
    assert (p8.dp_shard_dim, p8.dp_outer_dim, p8.hybrid_fsdp_group_dim) == ("dp_shard_cp", "dp_outer", "hsdp")


@pytest.mark.parametrize("outer", ["no_shard", "optim", 0, 1])
def test_hsdp_and_hfsdp_pass_outer_dim_and_hybrid_group(outer):
    p = plan(dims(dp_outer=2, dp_shard=1), zero=3, outer=outer)
    assert p.dp_outer_dim == "dp_outer" and p.hybrid_fsdp_group_dim == "hsdp"
    name = outer if isinstance(outer, str) else ("no_shard", "optim")[outer]
    assert p.outer_dp_sharding_strategy == name
    assert p.grad_norm_group == ("hybrid" if name == "optim" else "fsdp")


def test_dp_outer_one_means_plain_fsdp():
    p = plan(dims(dp_outer=1, dp_shard=2), outer="no_shard")
    assert p.dp_outer_dim is None and p.hybrid_fsdp_group_dim is None


@pytest.mark.parametrize("zero,name,norm,fmt", [
    (0, "no_shard", "none", "replicated"),
    (1, "optim", "fsdp", "dtensor"),
    (2, "optim_grads", "fsdp", "dtensor"),
    (3, "optim_grads_params", "fsdp", "dtensor"),
    ("optim_grads", "optim_grads", "fsdp", "dtensor"),
])
def test_zero_strategies(zero, name, norm, fmt):
    p = plan(zero=zero)
    assert (p.zero_dp_strategy, p.grad_norm_group, p.checkpoint_format) == (name, norm, fmt)


def test_hfsdp_needs_zero3_and_dp_outer():
    with pytest.raises(ConfigError, match="optim_grads_params"):
        plan(dims(dp_outer=2, dp_shard=1), zero=2, outer="optim")
    # The seed's (1, 2, 2, 2) mesh with outer optim: one outer rank, so plain FSDP.
    p = plan(dims(dp_shard=2), zero=3, outer="optim")
    assert (p.outer_dp_sharding_strategy, p.dp_outer_dim, p.grad_norm_group) == ("no_shard", None, "fsdp")


def test_meta_init_refused_with_no_shard():
    with pytest.raises(ConfigError) as e:
        plan(zero=0, init_on_meta=True)
    assert e.value.key == "model.init_on_meta"
    assert plan(zero=3, init_on_meta=True).init_model_with_meta_device


def test_no_mesh_path():
    p = plan(dims(dp_shard=2), mesh_enabled=False)
    assert not p.use_mesh
    assert (p.dp_shard_dim, p.dp_outer_dim, p.tp_dim, p.hybrid_fsdp_group_dim) == (None, None, None, None)


def test_precision_policy_dtypes():
    p = plan(precision=typed(PrecisionConfig, compute_dtype="bf16", main_params_dtype="fp32", main_grads_dtype="fp32",
                             grad_comm_dtype="bf16"))
    assert (p.compute_dtype, p.main_params_dtype, p.main_grads_dtype, p.grad_comm_dtype) == ("bf16", "fp32", "fp32", "bf16")
    p = plan(precision=typed(PrecisionConfig, compute_dtype=None, main_params_dtype=None, main_grads_dtype=None))
    assert (p.compute_dtype, p.main_params_dtype, p.main_grads_dtype) == ("fp32", None, None)
    p = plan(precision=typed(PrecisionConfig, compute_dtype="fp32", main_params_dtype="fp64", main_grads_dtype="fp32"))
    assert (p.main_params_dtype, p.main_grads_dtype) == ("fp64", "fp32")


def test_engine_switches_pass_through():
    e = MegatronFSDPConfig(name="megatron_fsdp", report_nan_in_param_grad=True, keep_fp8_transpose_cache=True,
                     use_decoupled_grad=True, sync_every_microbatch=True, fuse_wgrad_accumulation=True)
    p = plan(engine=e, cuda_graph=True)
    assert p.report_nan_in_param_grad and p.keep_fp8_transpose_cache and p.use_decoupled_grad
    assert p.fuse_wgrad_accumulation
    assert p.sync_model_each_microbatch and p.cuda_graph_mode
    d = plan().as_dict()
    assert not any(d[k] for k in ("report_nan_in_param_grad", "keep_fp8_transpose_cache", "use_decoupled_grad",
                                  "sync_model_each_microbatch", "cuda_graph_mode", "init_model_with_meta_device",
                                  "nccl_ub", "fsdp_double_buffer", "fuse_wgrad_accumulation"))
    ub = plan(engine=MegatronFSDPConfig(name="megatron_fsdp", nccl_ub=True))
    assert ub.nccl_ub and ub.fsdp_double_buffer  # user buffers need the persistent double buffer
    assert plan(engine=MegatronFSDPConfig(name="megatron_fsdp", fsdp_double_buffer=True)).fsdp_double_buffer


def test_engine_make_plan_uses_mesh_presence():
    kw = dict(engine_cfg=MegatronFSDPConfig(name="megatron_fsdp"), sharding_cfg=ShardingConfig(),
              precision_cfg=PrecisionConfig(), dims=dims(dp_shard=2), device=torch.device("cpu"))
    assert not MegatronFSDPEngine(mesh=None, **kw).make_plan(False).use_mesh
    assert MegatronFSDPEngine(mesh=object(), cuda_graph=True, **kw).make_plan(True).cuda_graph_mode


def test_zero3_without_unit_modules_is_a_config_error():
    class Spec:
        unit_modules = (torch.nn.Conv2d,)

    eng = MegatronFSDPEngine(engine_cfg=MegatronFSDPConfig(name="megatron_fsdp"), sharding_cfg=ShardingConfig(),
                             precision_cfg=PrecisionConfig(), dims=dims(dp_shard=2), mesh=None,
                             device=torch.device("cpu"))
    try:
        import megatron_fsdp  # noqa: F401
    except Exception:  # noqa: BLE001
        pytest.skip("megatron_fsdp not importable here")
    with pytest.raises(ConfigError) as e:
        eng.shard(torch.nn.Sequential(torch.nn.Linear(2, 2)), Spec(), init_on_meta=False)
    assert e.value.key == "model.fsdp_unit_modules"


def test_step_counters_reset_after_synthetic_step():
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([{"params": [w], "weight_decay": 0.1}], lr=0.1)
    w.grad = torch.zeros(3)
    opt.step()
    assert opt.state[w]["step"].item() == 1
    opt.param_groups[0]["step"] = 5  # TE FusedAdam keeps its count per group
    reset_step_counters(opt)
    assert opt.state[w]["step"].item() == 0 and opt.param_groups[0]["step"] == 0


def test_make_capturable_leaves_torch_adamw_as_it_is():
    """torch's AdamW steps eagerly between replays: its LR stays a number, its state untouched."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))], lr=1e-3)
    before = dict(opt.param_groups[0], params=None)
    make_capturable(opt, torch.device("cpu"))
    assert dict(opt.param_groups[0], params=None) == before and isinstance(opt.param_groups[0]["lr"], float)
    assert not hasattr(opt, "capturable")


def test_make_capturable_turns_fused_adam_capturable():
    opt = _FusedAdamLike(capturable=False)
    make_capturable(opt, torch.device("cpu"))
    assert opt.capturable and torch.is_tensor(opt.param_groups[0]["lr"])


class _FusedAdamLike(torch.optim.SGD):
    """What match_capturable reads of TE FusedAdam: `capturable` and a per-group step."""

    def __init__(self, capturable: bool):
        super().__init__([torch.nn.Parameter(torch.ones(1))], lr=1e-3)
        self.capturable = capturable


def test_loaded_lr_and_step_take_the_form_the_optimizer_steps_with():
    """A checkpoint from a non-graph run resumed under CUDA graphs gives device tensors, and one
    from a graph run resumed without them gives plain numbers."""
    graphed = _FusedAdamLike(capturable=True)
    graphed.param_groups[0].update(lr=2e-4, step=7)  # as loaded from a non-graph run
    match_capturable(graphed, torch.device("cpu"))
    group = graphed.param_groups[0]
    assert torch.is_tensor(group["lr"]) and float(group["lr"]) == pytest.approx(2e-4)
    assert torch.is_tensor(group["step"]) and int(group["step"]) == 7

    eager = _FusedAdamLike(capturable=False)
    eager.param_groups[0].update(lr=torch.tensor(3e-4), step=torch.tensor([9], dtype=torch.int))
    match_capturable(eager, torch.device("cpu"))
    group = eager.param_groups[0]
    assert isinstance(group["lr"], float) and group["lr"] == pytest.approx(3e-4)
    assert group["step"] == 9 and isinstance(group["step"], int)


def test_unwrap_compiled():
    m = torch.nn.Linear(1, 1)

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self._orig_mod = inner

    assert unwrap(Wrapper(m)) is m and unwrap(m) is m


def test_hfsdp_helper_buffer_gets_the_main_buffers_gradient_scaling():
    """0.6.1 leaves the HFSDP helper buffer's factor None (main grads then hold the SUM over
    the DP ranks); the engine copies the main buffer's 1/dp. Groups without a helper, and a
    helper that already has a factor, are left alone."""
    from types import SimpleNamespace as NS

    hfsdp = NS(main_grad_buffer=NS(gradient_scaling_factor=0.25), hfsdp_helper_gbuf=NS(gradient_scaling_factor=None))
    plain = NS(main_grad_buffer=NS(gradient_scaling_factor=0.5), hfsdp_helper_gbuf=None)
    fixed = NS(main_grad_buffer=NS(gradient_scaling_factor=0.25), hfsdp_helper_gbuf=NS(gradient_scaling_factor=0.125))
    model = NS(param_and_grad_buffer=NS(parameter_groups=[hfsdp, plain, fixed]))
    _restore_hfsdp_grad_scaling(model)
    assert hfsdp.hfsdp_helper_gbuf.gradient_scaling_factor == 0.25
    assert plain.hfsdp_helper_gbuf is None
    assert fixed.hfsdp_helper_gbuf.gradient_scaling_factor == 0.125


def test_a_unit_gradient_scaling_is_dropped_and_every_other_kept():
    """One data-parallel rank: factor 1.0 becomes None (main and HFSDP helper buffers); 1/dp on
    more ranks stays, and so does 1.0 under average_in_collective, where it selects AVG."""
    from types import SimpleNamespace as NS

    def model(factors, average=False):
        groups = [NS(main_grad_buffer=NS(gradient_scaling_factor=f), hfsdp_helper_gbuf=NS(gradient_scaling_factor=f))
                  for f in factors]
        return NS(ddp_config=NS(average_in_collective=average), param_and_grad_buffer=NS(parameter_groups=groups))

    def factors(m):
        return [(g.main_grad_buffer.gradient_scaling_factor, g.hfsdp_helper_gbuf.gradient_scaling_factor)
                for g in m.param_and_grad_buffer.parameter_groups]

    one, many, avg = model([1.0, 1.0]), model([0.5, 1.0]), model([1.0], average=True)
    for m in (one, many, avg):
        _skip_unit_grad_scaling(m)
    assert factors(one) == [(None, None), (None, None)]
    assert factors(many) == [(0.5, 0.5), (None, None)]  # the rule is per buffer: only the 1.0 goes
    assert factors(avg) == [(1.0, 1.0)]


def test_megatron_fsdp_sums_unscaled_gradients_without_touching_them_when_the_factor_is_none():
    """The premise of _skip_unit_grad_scaling, on the library's own function: 1.0 multiplies the
    bf16 bucket in place and sums; None only sums."""
    mfsdp_buffer = pytest.importorskip("megatron_fsdp.param_and_grad_buffer")
    from types import SimpleNamespace as NS

    config = NS(average_in_collective=False, gradient_reduce_div_fusion=True)
    grad = torch.full((4,), 3.0, dtype=torch.bfloat16)
    version = grad._version
    assert mfsdp_buffer.gradient_reduce_preprocessing(grad, None, config) == torch.distributed.ReduceOp.SUM
    assert grad._version == version  # not written
    assert mfsdp_buffer.gradient_reduce_preprocessing(grad, 1.0, config) == torch.distributed.ReduceOp.SUM
    assert grad._version > version  # the multiply it no longer runs


def test_tied_meta_parameters_are_materialized_once_for_every_module_that_holds_them():
    transformers = pytest.importorskip("transformers")
    from mfsdp_launch.engines.megatron import _materialize_shared_params
    from mfsdp_launch.models.hf.model import support_module_init

    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256, tie_word_embeddings=True)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    support_module_init(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    _materialize_shared_params(model, torch.device("cpu"))
    head = model.lm_head.weight
    assert head is model.model.embed_tokens.weight and not head.is_meta  # still one parameter, now real
    assert head.std().item() == pytest.approx(config.initializer_range, rel=0.1)  # initialized, HF's way
    assert model.model.layers[0].mlp.down_proj.weight.is_meta  # the rest is Megatron-FSDP's to materialize
