"""The CLI as users meet it: help, dry runs and one-line refusals, all before anything spawns."""

from conftest import ROOT, cli


def test_help():
    out = cli("--help")
    assert out.returncode == 0 and "usage: mfsdp-train" in out.stdout


def test_dry_run_prints_rank_table_groups_and_memory(tmp_path):
    out = cli("+recipe=hfsdp_fp8", "launcher.dry_run=true", "launcher.nproc_per_node=8", f"run.dir={tmp_path}/r")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "(2, 4, 1, 1)" in text
    for header in ("rank", "node", "local_rank", "dp_outer", "dp_shard", "hsdp group", "memory per rank"):
        assert header in text
    # rank 5 is dp_outer 1, dp_shard 1; its dp_shard group is 4-7
    row5 = [line for line in text.splitlines() if line.split()[:1] == ["5"]][0].split()
    assert row5[:8] == ["5", "0", "5", "1", "1", "0", "0", "5"] and row5[8] == "4-7"
    assert not (tmp_path / "r").exists()  # a dry run writes nothing


def test_bad_mesh_is_one_line_exit_2(tmp_path):
    out = cli("+recipe=cpu_smoke", "mesh.dp_shard=3", "launcher.nproc_per_node=4", "launcher.dry_run=true",
              f"run.dir={tmp_path}/r")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mfsdp-train: error: mesh:"), out.stderr
    assert "Traceback" not in out.stderr + out.stdout
    assert not (tmp_path / "r").exists()


def test_unknown_key_is_one_line_exit_2(tmp_path):
    out = cli("+recipe=cpu_smoke", "train.no_such_key=1", f"run.dir={tmp_path}/r")
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.no_such_key: unknown key" in lines[0], out.stderr
    assert not (tmp_path / "r").exists()


def test_show_config(tmp_path):
    out = cli("+recipe=cpu_smoke", "launcher.dry_run=true", "--cfg")
    assert out.returncode == 0 and "zero_dp_strategy: optim_grads_params" in out.stdout


def test_help_and_dry_run_do_not_import_torch():
    """Why they are fast: neither path imports torch (scripts/cli_latency.py measures the times)."""
    import subprocess
    import sys

    probe = ("import sys; from mfsdp_launch.cli import main; "
             "rc = main(sys.argv[1:]); assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    for args in (["--help"], ["+recipe=hfsdp_fp8", "launcher.dry_run=true", "launcher.nproc_per_node=8"]):
        out = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 0, out.stderr
