"""train.cpu_offload and fp8.recipe=torchao_*|fused_rowwise before anything is spawned (issue 26): one line where
they cannot run (a CPU run, a family without plain Linears, tp > 1; Megatron-FSDP takes torchao's
layers, without FP8 all-gather), the memory
estimate moves the offloaded state to the host, and the dry run's host-memory line refuses a run
this host cannot hold. In-process: planner.prepare on this (GPU-less) machine."""

import pytest

from helpers import refused
from mfsdp_launch.mesh import ParallelDims
from mfsdp_launch.planner import prepare
from mfsdp_launch.planner import memory

BIG = ["model=gpt", "model.preset=8b", "precision.compute_dtype=bf16", "train.seq_len=8192",
       "train.micro_batch_size=1", "model.activation_checkpointing=full", "launcher.nproc_per_node=8"]


@pytest.mark.parametrize("overrides,key,words", [
    # On the CPU both only mean something on a GPU: refused, the machine known or the backend said.
    (["train.cpu_offload=true"], "train.cpu_offload", "this machine has no CUDA GPU"),
    (["train.cpu_offload=true", "engine.backend=gloo", "launcher.dry_run=true"], "train.cpu_offload",
     "engine.backend=gloo runs on the CPU"),
    (["fp8.recipe=torchao_rowwise"], "fp8.recipe", "compute capability 8.9+"),
    (["fp8.recipe=fused_rowwise"], "fp8.recipe", "compute capability 8.9+"),
    (["fp8.recipe=fused_rowwise", "mesh.tp=2", "launcher.nproc_per_node=2", "launcher.dry_run=true"], "mesh.tp",
     "tensor-parallel styles"),
    (["fp8.recipe=fused_rowwise", "model=toy_cnn", "launcher.dry_run=true"], "fp8.recipe", "no plain nn.Linear"),
    # fp8.cache_weight_casts: fused_rowwise's, at grad_accum > 1, under FSDP2
    (["fp8.recipe=torchao_rowwise", "fp8.cache_weight_casts=true", "train.grad_accum_steps=2", "launcher.dry_run=true"],
     "fp8.cache_weight_casts", "has none of its own to keep"),
    (["fp8.cache_weight_casts=true", "train.grad_accum_steps=2", "launcher.dry_run=true"], "fp8.cache_weight_casts",
     "fp8.recipe=none has none"),
    (["fp8.recipe=fused_rowwise", "fp8.cache_weight_casts=true", "launcher.dry_run=true"], "fp8.cache_weight_casts",
     "does nothing at train.grad_accum_steps=1"),
    (["fp8.recipe=fused_rowwise", "fp8.cache_weight_casts=true", "train.grad_accum_steps=2", "engine=megatron_fsdp",
      "launcher.dry_run=true"], "fp8.cache_weight_casts", "wired for engine=fsdp2"),
    (["train.cpu_offload=true", "engine=megatron_fsdp", "launcher.dry_run=true"], "train.cpu_offload",
     "has no CPU offload"),
    (["fp8.recipe=torchao_rowwise", "model=toy_cnn", "launcher.dry_run=true"], "fp8.recipe", "no plain nn.Linear"),
    (["fp8.recipe=torchao_rowwise", "mesh.tp=2", "launcher.nproc_per_node=2", "launcher.dry_run=true"], "mesh.tp",
     "tensor-parallel styles"),
    (["fp8.recipe=torchao_rowwise", "fp8.params=true", "launcher.dry_run=true"], "fp8.params", "TE's FP8"),
    (["fp8.recipe=torchao_rowwise", "engine=megatron_fsdp", "train.cuda_graph=full_iteration", "optim.impl=te_fused",
      "launcher.dry_run=true"], "fp8.recipe", "full_iteration"),
    (["fp8.recipe=delayed", "launcher.dry_run=true"], "fp8.recipe", "torchao_tensorwise|torchao_rowwise"),
])
def test_refused_in_one_line(overrides, key, words):
    exc = refused(*overrides, hardware="launcher.dry_run=true" not in overrides)
    assert exc.key == key and words in str(exc) and "\n" not in str(exc), str(exc)


@pytest.mark.parametrize("recipe", ["torchao_rowwise", "torchao_tensorwise", "fused_rowwise"])
@pytest.mark.parametrize("extra", [[], ["model.preset=tiny_moe"]])
def test_megatron_fsdp_takes_torchao_without_fp8_all_gather(recipe, extra):
    from mfsdp_launch.engines import ENGINES

    cfg, _ = prepare([f"fp8.recipe={recipe}", "engine=megatron_fsdp", "launcher.dry_run=true", *extra],
                     check_hardware=False)
    assert str(cfg.fp8.recipe) == recipe
    caps = ENGINES["megatron_fsdp"]
    assert caps.linear_fp8 and not caps.torchao_fp8_all_gather and ENGINES["fsdp2"].torchao_fp8_all_gather


def test_offload_moves_the_state_to_the_host_and_the_host_line_refuses_what_does_not_fit(monkeypatch):
    cfg, _ = prepare([*BIG, "launcher.dry_run=true"], check_hardware=False)
    off, _ = prepare([*BIG, "train.cpu_offload=true", "launcher.dry_run=true"], check_hardware=False)
    dims = ParallelDims.from_config(cfg.mesh, 8)
    on_gpu, offloaded = memory.estimate(cfg, dims), memory.estimate(off, dims)
    assert offloaded.params == offloaded.main_params == offloaded.grads == offloaded.optimizer == 0
    assert offloaded.total < on_gpu.total - 10 * memory.GIB and on_gpu.host == 0
    # fp32 main weights, fp32 sharded gradients and two Adam moments: 16 bytes a parameter, / 8 ranks
    n = 8_030_261_248
    assert offloaded.host == pytest.approx(16 * n / 8, rel=1e-6)
    need = memory.host_bytes_per_node(off, dims)
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: need - 1)
    assert "(a run here is refused)" in memory.host_line(off, dims)
    with pytest.raises(Exception) as exc:
        memory.check_host_fits(off, dims)
    assert "of host memory per node" in str(exc.value)
    monkeypatch.setattr(memory, "host_memory_bytes", lambda: need + 1)
    assert memory.check_host_fits(off, dims) is None and "refused" not in memory.host_line(off, dims)
    assert memory.host_line(cfg, dims) is None
