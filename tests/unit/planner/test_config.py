"""Schema, composition and every validation rule: each refusal names its key."""

import pytest

from helpers import ROOT, cli, refused
from mfsdp_launch.planner import prepare
from mfsdp_launch.planner.compose import compose, config_dir
from mfsdp_launch.core.errors import ConfigError

RECIPES = ["cpu_smoke", "fsdp_bf16", "hsdp_bf16", "hfsdp_bf16", "hfsdp_fp8"]


def checked(*overrides, hardware=False):
    return prepare(list(overrides), check_hardware=hardware)


def test_recipes_are_a_config_group():
    assert sorted(p.stem for p in (config_dir() / "recipe").glob("*.yaml")) == sorted(RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_validates_for_a_dry_run(recipe):
    cfg, _ = checked(f"+recipe={recipe}", "launcher.nproc_per_node=8")
    assert cfg.run.name == recipe
    assert cfg.mesh.dp_shard > 0  # inferred and frozen


def test_hfsdp_fp8_recipe_contents():
    cfg, _ = checked("+recipe=hfsdp_fp8", "launcher.nproc_per_node=8")
    assert (cfg.mesh.dp_outer, cfg.mesh.dp_shard) == (1, 8)  # dp_outer=nodes: plain FSDP on one node
    cfg, _ = checked("+recipe=hfsdp_fp8", "launcher.nproc_per_node=8", "launcher.nnodes=2",
                     "launcher.rdzv_endpoint=h:1")
    assert (cfg.mesh.dp_outer, cfg.mesh.dp_shard) == (2, 8)  # one outer replica per node
    cfg, _ = checked("+recipe=hfsdp_fp8", "launcher.nproc_per_node=8", "mesh.dp_outer=2")
    assert (cfg.mesh.dp_outer, cfg.mesh.dp_shard) == (2, 4)
    assert cfg.sharding.outer_dp_sharding_strategy.name == "optim"
    assert cfg.sharding.zero_dp_strategy.name == "optim_grads_params"
    assert cfg.fp8.recipe == "current" and cfg.model.name == "te_gpt" and not cfg.fp8.params
    assert cfg.engine.name == "megatron_fsdp"


def test_cpu_smoke_is_fsdp2_on_two_processes():
    cfg, _ = checked("+recipe=cpu_smoke")
    assert cfg.engine.name == "fsdp2" and cfg.launcher.nproc_per_node == 2 and cfg.data.name == "text"


def test_defaults():
    cfg, _ = checked()
    assert cfg.sharding.zero_dp_strategy.name == "optim_grads_params"  # default 3
    assert cfg.sharding.outer_dp_sharding_strategy.name == "no_shard"
    assert "${" not in cfg.run.dir and cfg.run.dir == "runs/run"


def test_run_dir_is_deterministic():
    a, _ = checked("+recipe=cpu_smoke")
    b, _ = checked("+recipe=cpu_smoke")
    assert a.run.dir == b.run.dir == "runs/cpu_smoke"


@pytest.mark.parametrize("value,name", [(0, "no_shard"), (1, "optim"), (2, "optim_grads"), (3, "optim_grads_params"),
                                        ("optim_grads", "optim_grads")])
def test_zero_strategy_names_and_numbers(value, name):
    cfg, _ = checked("engine=megatron_fsdp", f"sharding.zero_dp_strategy={value}")
    assert cfg.sharding.zero_dp_strategy.name == name


# (overrides, key the message must name)
REFUSALS = [
    (["train.no_such_key=1"], "train.no_such_key"),
    (["no_such_group_key=1"], "no_such_group_key"),
    (["train.steps=abc"], "train.steps"),
    (["model=nope"], "model"),
    (["+recipe=nope"], "+recipe"),
    (["mesh.dp_shard=3", "launcher.nproc_per_node=4"], "mesh"),
    (["mesh.dp_outer=3", "launcher.nproc_per_node=4"], "mesh.dp_shard"),
    (["mesh.tp=0"], "mesh.tp"),
    (["sharding.zero_dp_strategy=7"], "sharding.zero_dp_strategy"),
    (["sharding.zero_dp_strategy=everything"], "sharding.zero_dp_strategy"),
    (["sharding.outer_dp_sharding_strategy=2"], "sharding.outer_dp_sharding_strategy"),
    # outer optim needs zero 3
    (["engine=megatron_fsdp", "mesh.dp_outer=2", "launcher.nproc_per_node=4", "sharding.zero_dp_strategy=2",
      "sharding.outer_dp_sharding_strategy=optim"], "sharding.outer_dp_sharding_strategy"),
    # meta init refused with no_shard on Megatron-FSDP
    (["engine=megatron_fsdp", "sharding.zero_dp_strategy=no_shard", "model.init_on_meta=true"], "model.init_on_meta"),
    # what FSDP2 cannot express
    (["engine=fsdp2", "sharding.zero_dp_strategy=optim"], "sharding.zero_dp_strategy"),
    (["engine=fsdp2", "mesh.dp_outer=2", "launcher.nproc_per_node=2", "sharding.outer_dp_sharding_strategy=optim"],
     "sharding.outer_dp_sharding_strategy"),
    (["engine=fsdp2", "model=toy_cnn", "mesh.tp=2", "launcher.nproc_per_node=2"], "mesh.tp"),
    # precision
    (["precision.compute_dtype=fp8"], "precision.compute_dtype"),
    (["precision.compute_dtype='null'"], "precision.compute_dtype"),
    (["precision.main_params_dtype=int8"], "precision.main_params_dtype"),
    (["engine=fsdp2", "precision.main_params_dtype=bf16"], "precision.main_params_dtype"),
    # FP8
    (["fp8.recipe=fancy"], "fp8.recipe"),
    (["fp8.recipe=current"], "fp8.recipe"),  # gpt has no TE layers: it would do nothing
    (["fp8.params=true"], "fp8.params"),
    (["model=te_gpt", "fp8.recipe=current", "fp8.params=true"], "fp8.params"),  # fsdp2
    (["model=te_gpt", "engine=megatron_fsdp", "fp8.recipe=current", "fp8.params=true",
      "sharding.zero_dp_strategy=2"], "fp8.params"),
    (["model=te_gpt", "engine=megatron_fsdp", "fp8.recipe=current", "fp8.params=true",
      "precision.main_params_dtype=null", "engine.keep_fp8_transpose_cache=true"], "precision.main_params_dtype"),
    (["model=te_gpt", "engine=megatron_fsdp", "fp8.recipe=delayed", "fp8.params=true"],
     "engine.keep_fp8_transpose_cache"),
    (["fp8.format=E5M2"], "fp8.format"),
    # the name that picks a typed section: refused with its own key, not as an override error
    (["engine.name=foo"], "engine"),
    (["model.name=foo"], "model"),
    (["fp8.skip=[lm_head]"], "fp8.skip"),  # no FP8 at all: the skip would do nothing
    (["model=te_gpt", "engine=megatron_fsdp", "fp8.recipe=current", "fp8.params=true", "fp8.skip=[lm_head]",
      "engine.keep_fp8_transpose_cache=true", "model.init_on_meta=true"], "fp8.skip"),
    # TE's init of FP8 parameters built on the GPU fails (seen on one H200): meta init only
    (["model=te_gpt", "engine=megatron_fsdp", "fp8.recipe=current", "fp8.params=true",
      "engine.keep_fp8_transpose_cache=true"], "model.init_on_meta"),
    (["model=te_gpt", "engine=megatron_fsdp", "fp8.recipe=current", "model.vocab_size=1000"], "model.vocab_size"),
    (["model=te_gpt", "engine=megatron_fsdp", "fp8.recipe=current", "train.seq_len=100",
      "train.micro_batch_size=1"], "train.micro_batch_size*train.seq_len"),
    # model
    (["model.preset=999b"], "model.preset"),
    (["model.dim=65"], "model.dim"),
    (["model.n_kv_heads=3"], "model.n_kv_heads"),  # "3 does not divide n_heads=4"
    (["model=gpt", "engine=megatron_fsdp", "mesh.tp=2", "launcher.nproc_per_node=2"], "mesh.tp"),
    (["model=te_gpt", "engine=fsdp2", "mesh.cp=2", "launcher.nproc_per_node=2"], "mesh.cp"),
    (["model=toy_transformer", "data=text"], "data"),
    (["model=toy_transformer", "model.n_heads=1", "engine=megatron_fsdp", "mesh.tp=2",
      "launcher.nproc_per_node=2"], "mesh.tp"),
    (["model=toy_cnn", "engine=megatron_fsdp", "mesh.cp=2", "train.seq_len=3", "launcher.nproc_per_node=2"],
     "train.seq_len"),
    (["data=text", "model.vocab_size=100"], "model.vocab_size"),
    (["model.freeze=[nothing.matches.*]"], "model.freeze"),
    # train / optim
    (["train.steps=0"], "train.steps"),
    (["train.micro_batch_size=0"], "train.micro_batch_size"),
    (["train.grad_accum_steps=0"], "train.grad_accum_steps"),
    (["train.grad_clip=-1"], "train.grad_clip"),
    (["train.stall_dump_s=0"], "train.stall_dump_s"),
    (["train.cuda_graph=sometimes"], "train.cuda_graph"),
    (["train.cuda_graph=full_iteration"], "engine"),
    (["engine=megatron_fsdp", "train.cuda_graph=full_iteration"], "precision.main_grads_dtype"),
    (["engine=megatron_fsdp", "train.cuda_graph=full_iteration", "precision.main_grads_dtype=fp32",
      "train.grad_accum_steps=2"], "train.grad_accum_steps"),
    (["fp8.attention=true"], "fp8.attention"),
    (["engine=megatron_fsdp", "model=te_gpt", "fp8.recipe=blockwise", "fp8.attention=true"], "fp8.attention"),
    (["engine=megatron_fsdp", "model=te_gpt", "fp8.recipe=current", "fp8.attention=true"], "fp8.attention"),
    (["engine=megatron_fsdp", "model=te_gpt", "fp8.recipe=delayed", "fp8.attention=true", "mesh.cp=2",
      "launcher.nproc_per_node=2", "model.preset=125m"], "fp8.attention"),
    (["engine=megatron_fsdp", "train.cuda_graph=full_iteration", "optim.impl=te_fused", "model.loss_kernel=te_fused"],
     "model.loss_kernel"),
    (["optim.lr=0"], "optim.lr"),
    (["optim.impl=te_fused"], "optim.impl"),
    (["engine=megatron_fsdp", "engine.use_decoupled_grad=true"], "engine.use_decoupled_grad"),
    (["optim.min_lr_ratio=2"], "optim.min_lr_ratio"),
    # checkpoint
    (["checkpoint.resume=sometimes"], "checkpoint.resume"),
    (["checkpoint.keep_last=0"], "checkpoint.keep_last"),
    (["checkpoint.load_weights_only=true"], "checkpoint.load_weights_only"),
    (["checkpoint.load_step=5", "checkpoint.resume=never"], "checkpoint.load_step"),
    # launcher
    (["launcher.nnodes=2"], "launcher.rdzv_endpoint"),
    (["launcher.nnodes=2", "launcher.rdzv_endpoint=hostonly"], "launcher.rdzv_endpoint"),
    (["launcher.node_rank=1"], "launcher.node_rank"),
    (["launcher.nproc_per_node=0"], "launcher.nproc_per_node"),
    (["mesh.enabled=false"], "mesh.enabled"),
    (["engine=megatron_fsdp", "mesh.enabled=false", "mesh.dp_outer=2", "launcher.nproc_per_node=2"], "mesh.enabled"),
    (["engine.backend=mpi"], "engine.backend"),
    # TE's wgrad fusion: a megatron_fsdp key, on TE layers, outside a captured graph
    (["engine.fuse_wgrad_accumulation=true"], "engine.fuse_wgrad_accumulation"),  # fsdp2: unknown key
    (["engine=megatron_fsdp", "engine.fuse_wgrad_accumulation=true"], "engine.fuse_wgrad_accumulation"),  # gpt
    (["engine=megatron_fsdp", "model=te_gpt", "engine.fuse_wgrad_accumulation=true",
      "train.cuda_graph=full_iteration"], "engine.fuse_wgrad_accumulation"),
]


@pytest.mark.parametrize("overrides,key", REFUSALS, ids=[" ".join(o) for o, _ in REFUSALS])
def test_refusals_name_the_key(overrides, key):
    err = refused(*overrides)
    assert err.key == key, str(err)
    line = str(err)
    assert "\n" not in line and line.startswith(key)


def test_unknown_key_lists_allowed_keys():
    err = refused("train.no_such_key=1")
    assert "steps" in err.allowed and "micro_batch_size" in err.allowed


def test_odd_vocab_is_fine_when_the_head_skips_fp8():
    checked("model=te_gpt", "engine=megatron_fsdp", "fp8.recipe=current", "model.vocab_size=1000",
            "fp8.skip=[lm_head]")


def test_wgrad_fusion_is_accepted_on_te_layers():
    cfg, _ = checked("engine=megatron_fsdp", "model=te_gpt", "engine.fuse_wgrad_accumulation=true",
                     "train.grad_accum_steps=4", "sharding.zero_dp_strategy=optim")
    assert cfg.engine.fuse_wgrad_accumulation


def test_full_iteration_cuda_graph_accepts_the_seed_setup():
    checked("engine=megatron_fsdp", "model=toy_transformer", "train.cuda_graph=full_iteration",
            "optim.impl=te_fused", "precision.main_grads_dtype=fp32")


@pytest.mark.parametrize("impl", ["torch", "fused", "te_fused"])
def test_full_iteration_cuda_graph_takes_compile_and_any_adamw(impl):
    # the optimizer steps eagerly between replays; the compiled blocks are captured like any kernel
    cfg, _ = checked("engine=megatron_fsdp", "model=gpt", "model.preset=tiny", "train.cuda_graph=full_iteration",
                     f"optim.impl={impl}", "precision.main_grads_dtype=fp32", "train.compile=true")
    assert cfg.train.compile and str(cfg.train.cuda_graph) == "full_iteration"


def test_megatron_fsdp_needs_a_gpu_when_not_a_dry_run(monkeypatch):
    monkeypatch.setattr("mfsdp_launch.planner.machine.local_gpu_count", lambda: 0)
    err = refused("engine=megatron_fsdp", hardware=True)
    assert err.key == "engine" and "CUDA" in str(err)


def test_too_many_processes_for_the_gpus(monkeypatch):
    monkeypatch.setattr("mfsdp_launch.planner.machine.local_gpu_count", lambda: 2)
    err = refused("engine=megatron_fsdp", "launcher.nproc_per_node=4", hardware=True)
    assert err.key == "launcher.nproc_per_node"


def test_fsdp2_runs_on_cpu_with_gloo(monkeypatch):
    monkeypatch.setattr("mfsdp_launch.planner.machine.local_gpu_count", lambda: 0)
    checked("+recipe=cpu_smoke", hardware=True)


def test_freeze_glob_that_matches_is_accepted():
    cfg, _ = checked("model=toy_transformer", "model.freeze=[transformer.encoder.*]")
    assert list(cfg.model.freeze) == ["transformer.encoder.*"]


def test_megatron_only_switches_are_unknown_under_fsdp2():
    """Each engine's section (engines/config.py) holds only its own keys."""
    with pytest.raises(ConfigError) as e:
        checked("engine=fsdp2", "engine.nccl_ub=true")
    assert e.value.key == "engine.nccl_ub" and e.value.problem == "unknown key"
    assert "nccl_ub" not in e.value.allowed and "sync_every_microbatch" in e.value.allowed
    _, warnings = checked("engine=megatron_fsdp", "model=toy_transformer", "engine.nccl_ub=true")
    assert not any("does nothing" in w for w in warnings)
    assert any("NCCL_NVLS_ENABLE=1" in w for w in warnings)


def test_cross_node_warning_in_validation():
    _, warnings = checked("launcher.nnodes=2", "launcher.nproc_per_node=2", "launcher.rdzv_endpoint=h:1")
    assert any("dp_shard" in w and "span" in w for w in warnings)


def test_missing_te_is_a_warning_in_dry_run_and_an_error_otherwise(monkeypatch):
    monkeypatch.setattr("mfsdp_launch.planner.machine.local_gpu_count", lambda: 8)
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("Transformer Engine is installed here")
    _, warnings = checked("+recipe=hfsdp_fp8", "launcher.nproc_per_node=8")
    assert any("transformer_engine" in w for w in warnings)
    err = refused("+recipe=hfsdp_fp8", "launcher.nproc_per_node=8", hardware=True)
    assert "transformer_engine" in str(err) and err.key == "model"


def test_broken_engine_install_is_one_line(monkeypatch, tmp_path):
    """A package that is present but fails to import (like a half-installed TE) is named before spawning."""
    pkg = tmp_path / "megatron_fsdp"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('libtransformer_engine.so: cannot open shared object')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "megatron_fsdp", raising=False)
    monkeypatch.setattr("mfsdp_launch.planner.machine.local_gpu_count", lambda: 2)
    err = refused("engine=megatron_fsdp", hardware=True)
    assert err.key == "engine" and "installed but broken (RuntimeError: libtransformer_engine.so" in str(err)
    assert "\n" not in str(err)


def test_model_names_from_a_separate_process_match_the_in_process_build(monkeypatch):
    """The TE path builds the model in a short-lived process (no CUDA context kept by the
    launcher); its names are the ones an in-process meta build gives."""
    from omegaconf import OmegaConf

    from mfsdp_launch.models import meta

    cfg = compose(["model.preset=tiny", "model.freeze=[tok_emb.*]"])
    monkeypatch.setattr(meta, "te_installed", lambda: True)  # the gpt model builds without TE
    names = meta.meta_names_isolated(OmegaConf.to_container(cfg.model, enum_to_str=True), cfg.train.seq_len)
    assert names is not None
    assert list(names) == list(meta.meta_names(cfg.model, cfg.train.seq_len))
    assert "tok_emb.weight" in names[0] and "layers.0" in names[1]


def test_seed_meshes_the_old_rules_refused_are_accepted():
    # toy_cnn has no attention heads: tp=2 is the seed's mesh, not a head-divisibility question.
    checked("engine=megatron_fsdp", "model=toy_cnn", "mesh.dp_shard=2", "mesh.cp=2", "mesh.tp=2",
            "launcher.nproc_per_node=8")
    _, warnings = checked("engine=megatron_fsdp", "model=toy_transformer", "mesh.dp_outer=1", "mesh.dp_shard=2",
                          "mesh.cp=2", "mesh.tp=2", "launcher.nproc_per_node=8",
                          "sharding.outer_dp_sharding_strategy=optim")
    assert any("outer dimension has one rank" in w for w in warnings)


def test_the_string_null_is_not_a_dtype():
    err = refused("precision.compute_dtype='null'")
    assert err.key == "precision.compute_dtype" and "null" in str(err)


@pytest.mark.parametrize("overrides,key", [
    (["data.path=/nonexistent/corpus"], "data.path"),
    (["data.path={empty}"], "data.path"),
    (["data.path=/nonexistent/*.txt"], "data.path"),
    (["data.max_bytes=0"], "data.max_bytes"),
    (["data.tokenizer=bogus"], "data.tokenizer"),
], ids=["missing", "empty-dir", "glob-no-match", "max-bytes-0", "bogus-tokenizer"])
def test_data_problems_are_one_line_before_anything_is_spawned(overrides, key, tmp_path):
    (tmp_path / "empty").mkdir()
    overrides = [o.format(empty=tmp_path / "empty") for o in overrides]
    run_dir = tmp_path / "run"
    r = cli("+recipe=cpu_smoke", f"run.dir={run_dir}", *overrides)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.startswith(f"mfsdp-train: error: {key}:") and r.stderr.count("\n") == 1, r.stderr
    assert "ranks, run.dir=" not in r.stdout  # nothing spawned
    assert not run_dir.exists()  # nothing written


def test_the_config_layer_and_the_cli_never_import_torch():
    import subprocess
    import sys

    code = ("import sys, importlib, pkgutil\n"
            "import mfsdp_launch.planner as c, mfsdp_launch.models as m\n"
            "for info in pkgutil.iter_modules(c.__path__): importlib.import_module('mfsdp_launch.planner.' + info.name)\n"
            "import mfsdp_launch.launcher.cli, mfsdp_launch.launcher.launch, mfsdp_launch.engines, mfsdp_launch.mesh, mfsdp_launch.planner.memory\n"
            "from mfsdp_launch.planner import prepare\n"
            "cfg, _ = prepare(['+recipe=hfsdp_fp8', 'launcher.nproc_per_node=8'], check_hardware=False)\n"
            "from mfsdp_launch.planner.memory import estimate\n"
            "from mfsdp_launch.mesh import ParallelDims\n"
            "estimate(cfg, ParallelDims(2, 4, 1, 1))\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr


def test_fused_loss_kernel_belongs_to_the_gpt_families_and_needs_cuda(monkeypatch):
    err = refused("model=toy_transformer", "engine=fsdp2", "model.loss_kernel=te_fused")
    assert err.key == "model.loss_kernel" and "(a key of model=gpt|te_gpt|hf)" in str(err)
    from mfsdp_launch.planner import machine

    cfg, _ = checked("model=gpt", "model.loss_kernel=te_fused")
    assert machine.needs_cuda(cfg)[0] == "model.loss_kernel" and "Triton" in machine.needs_cuda(cfg)[1]
    monkeypatch.setattr(machine, "import_problem", lambda module, probe: "not installed" if "transformer" in module else "")
    with pytest.raises(ConfigError) as exc:
        machine.check_installs(cfg, probe=False)
    assert exc.value.key == "model.loss_kernel"


def test_nccl_user_buffers_need_an_nccl_allocator(monkeypatch):
    from mfsdp_launch.planner import machine

    cfg, _ = checked("engine=megatron_fsdp", "model=toy_transformer", "engine.nccl_ub=true")
    monkeypatch.setattr(machine, "import_problem", lambda module, probe: "not installed" if "nccl_allocator" in module else "")
    with pytest.raises(ConfigError) as exc:
        machine.check_installs(cfg, probe=False)
    assert exc.value.key == "engine.nccl_ub" and "megatron-core" in str(exc.value)
    monkeypatch.setattr(machine, "import_problem", lambda module, probe: "not installed" if "apex" in module else "")
    machine.check_installs(cfg, probe=False)  # megatron.core's allocator is enough
