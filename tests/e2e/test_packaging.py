"""A non-editable install finds its configs and recipes from anywhere."""

import os
import subprocess
import sys

import pytest

from helpers import ROOT


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT)], check=True, capture_output=True, text=True)
    return target


def run_installed(target, cwd, *code_or_args, module=False):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    cmd = [sys.executable, "-m", "mfsdp_launch", *code_or_args] if module else [sys.executable, "-c", *code_or_args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_configs_and_recipes_ship_in_the_wheel(installed, tmp_path):
    out = run_installed(installed, tmp_path, "from mfsdp_launch.planner.compose import config_dir; print(config_dir())")
    assert out.returncode == 0, out.stderr
    where = out.stdout.strip()
    assert where.startswith(str(installed)), where
    recipes = sorted(p for p in os.listdir(os.path.join(where, "recipe")))
    assert "cpu_smoke.yaml" in recipes and "hfsdp_fp8.yaml" in recipes


def test_installed_cli_dry_run_from_elsewhere(installed, tmp_path):
    out = run_installed(installed, tmp_path, "+recipe=hfsdp_fp8", "mesh.dp_outer=2", "launcher.dry_run=true",
                        "launcher.nproc_per_node=8", module=True)
    assert out.returncode == 0, out.stderr
    assert "rank" in out.stdout and "(2, 4, 1, 1)" in out.stdout
