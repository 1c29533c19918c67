"""launcher.nproc_per_node=auto: every visible GPU (2 CPU processes without one), resolved once,
and the single-node HFSDP cost warning."""

import pytest

from helpers import cli, refused
from mfsdp_launch.core import hardware
from mfsdp_launch.planner import prepare

GPU_RECIPES = ["fsdp_bf16", "hsdp_bf16", "hfsdp_bf16", "hfsdp_fp8"]


def gpus(monkeypatch, n):
    monkeypatch.setattr(hardware, "local_gpu_count", lambda: n)


@pytest.mark.parametrize("recipe", GPU_RECIPES)
@pytest.mark.parametrize("n", [2, 8])
def test_recipes_default_to_every_gpu(monkeypatch, recipe, n):
    gpus(monkeypatch, n)
    cfg, _ = prepare([f"+recipe={recipe}"], check_hardware=False)
    assert cfg.launcher.nproc_per_node == n and cfg.launcher.nproc_auto == f"{n} visible GPU(s)"
    assert cfg.mesh.dp_outer * cfg.mesh.dp_shard == n


def test_fsdp_recipe_on_one_gpu(monkeypatch):
    gpus(monkeypatch, 1)
    cfg, _ = prepare(["+recipe=fsdp_bf16"], check_hardware=False)
    assert (cfg.launcher.nproc_per_node, cfg.mesh.dp_shard) == (1, 1)


@pytest.mark.parametrize("recipe", ["hfsdp_fp8", "hsdp_bf16", "hfsdp_bf16"])
@pytest.mark.parametrize("n", [1, 2, 8])
def test_outer_recipes_run_on_any_gpu_count_of_one_node(monkeypatch, recipe, n):
    gpus(monkeypatch, n)
    cfg, _ = prepare([f"+recipe={recipe}"], check_hardware=False)  # mesh.dp_outer=nodes
    assert (cfg.launcher.nproc_per_node, cfg.mesh.dp_outer, cfg.mesh.dp_shard) == (n, 1, n)


def test_a_fixed_outer_degree_on_one_gpu_names_the_override(monkeypatch):
    gpus(monkeypatch, 1)
    e = refused("+recipe=hfsdp_fp8", "mesh.dp_outer=2")
    assert e.key == "mesh.dp_outer" and "mesh.dp_outer=1" in str(e) and "1 visible GPU" in str(e)


@pytest.mark.parametrize("value", ["node", "2.5", "true"])
def test_dp_outer_takes_a_number_or_nodes(value):
    e = refused("+recipe=hfsdp_fp8", f"mesh.dp_outer={value}", "launcher.nproc_per_node=2")
    assert e.key == "mesh.dp_outer" and "nodes" in str(e)


def test_cpu_machine_gets_two_processes(monkeypatch):
    gpus(monkeypatch, 0)
    cfg, _ = prepare(["+recipe=cpu_smoke", "launcher.nproc_per_node=auto"], check_hardware=True)
    assert cfg.launcher.nproc_per_node == hardware.CPU_AUTO_PROCESSES == 2 and "no GPU" in cfg.launcher.nproc_auto


def test_a_number_still_wins(monkeypatch):
    gpus(monkeypatch, 8)
    cfg, _ = prepare(["+recipe=hfsdp_fp8", "launcher.nproc_per_node=4"], check_hardware=False)
    assert cfg.launcher.nproc_per_node == 4 and cfg.launcher.nproc_auto is None


@pytest.mark.parametrize("overrides", [["launcher.nproc_per_node=many"], ["launcher.nproc_per_node=1.5"],
                                       ["launcher.nproc_per_node=auto", "launcher.kind=slurm"]])
def test_bad_values_name_the_key(overrides):
    assert refused(*overrides).key == "launcher.nproc_per_node"


def test_slurm_auto_takes_gpus_per_node():
    cfg, _ = prepare(["+recipe=fsdp_bf16", "launcher.kind=slurm", "launcher.gpus_per_node=4"], check_hardware=False)
    assert cfg.launcher.nproc_per_node == 4


def test_single_node_outer_dim_warns(monkeypatch):
    gpus(monkeypatch, 8)
    _, warnings = prepare(["+recipe=hfsdp_fp8", "mesh.dp_outer=2"], check_hardware=False)
    assert [w for w in warnings if w.startswith("mesh.dp_outer=2 with all 8 ranks on one node")]
    _, warnings = prepare(["+recipe=hfsdp_fp8", "launcher.nnodes=2", "launcher.rdzv_endpoint=h:1"],
                          check_hardware=False)
    assert not [w for w in warnings if "on one node" in w]  # across nodes the outer dimension is the point
    _, warnings = prepare(["+recipe=fsdp_bf16"], check_hardware=False)
    assert not [w for w in warnings if "on one node" in w]


def test_dry_run_shows_what_auto_became(tmp_path):
    out = cli("+recipe=hfsdp_bf16", "mesh.dp_outer=2", "launcher.dry_run=true", f"run.dir={tmp_path}/r",
              env={"CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr
    assert "world=2 (1 node(s) x 2, nproc_per_node=auto: no GPU here: 2 CPU processes)" in out.stdout
    assert "(2, 1, 1, 1)" in out.stdout and "plain FSDP (mesh.dp_outer=1)" in out.stdout
