"""The CLI as users meet it: help, dry runs and one-line refusals, all before anything spawns."""

from helpers import ROOT, cli


def test_help():
    out = cli("--help")
    assert out.returncode == 0 and "usage: mfsdp-train" in out.stdout


def test_dry_run_prints_rank_table_groups_and_memory(tmp_path):
    out = cli("+recipe=hfsdp_fp8", "mesh.dp_outer=2", "launcher.dry_run=true", "launcher.nproc_per_node=8", f"run.dir={tmp_path}/r")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "(2, 4, 1, 1)" in text
    for header in ("rank", "node", "local_rank", "dp_outer", "dp_shard", "hsdp", "group", "memory per rank"):
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


def test_cfg_prints_and_exits_without_training(tmp_path):
    """As Hydra's --cfg: show the config, run nothing (also without launcher.dry_run)."""
    out = cli("+recipe=cpu_smoke", f"run.dir={tmp_path}/r", "--cfg", "job", timeout=120)
    assert out.returncode == 0, out.stderr
    assert "zero_dp_strategy: optim_grads_params" in out.stdout and f"dir: {tmp_path}/r" in out.stdout
    assert "ranks, run.dir=" not in out.stdout and "world=" not in out.stdout
    assert not (tmp_path / "r").exists()


def test_version_and_help_list_the_exit_codes():
    from mfsdp_launch import __version__
    from mfsdp_launch.core import exit_codes

    out = cli("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"mfsdp-launch {__version__}" and not out.stderr
    text = cli("--help").stdout
    for code, meaning in exit_codes.MEANING.items():
        assert f"  {code}  {meaning}" in text


def test_no_arguments_prints_a_usage_hint_and_trains_nothing(tmp_path):
    out = cli(cwd=tmp_path, timeout=60)
    assert out.returncode == 2
    assert out.stderr.startswith("mfsdp-train: nothing to train") and "+recipe=cpu_smoke" in out.stderr
    assert list(tmp_path.iterdir()) == []  # no runs/ folder, no random-token training


def test_unknown_option_is_one_line(tmp_path):
    out = cli("+recipe=cpu_smoke", "--bogus", timeout=60)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "mfsdp-train: error: --bogus: unknown option (allowed: --help|--version|--cfg|--config-dir|--multirun|"
        "--shell-completion and key=value overrides)"]


def own_recipes(tmp_path):
    folder = tmp_path / "my_configs" / "recipe"
    folder.mkdir(parents=True)
    (folder / "mine.yaml").write_text("# @package _global_\ndefaults:\n  - /recipe/cpu_smoke\n"
                                      "train:\n  steps: 7\n  seq_len: 96\n")
    (folder / "broken.yaml").write_text("# @package _global_\ntrain:\n  steps: 5\n  seq_len: [1, 2\nrun:\n  name: x\n")
    return tmp_path / "my_configs"


def test_own_recipes_with_config_dir_or_hydra_searchpath(tmp_path):
    configs = own_recipes(tmp_path)
    for how in (["--config-dir", str(configs)], [f"--config-dir={configs}"], [f"hydra.searchpath=[file://{configs}]"]):
        out = cli(*how, "+recipe=mine", "--cfg", timeout=120)
        assert out.returncode == 0, (how, out.stderr)
        assert "steps: 7" in out.stdout and "seq_len: 96" in out.stdout and "name: cpu_smoke" in out.stdout


def test_yaml_error_in_an_own_recipe_names_the_file_and_line(tmp_path):
    configs = own_recipes(tmp_path)
    out = cli("--config-dir", str(configs), "+recipe=broken", "launcher.dry_run=true", timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith(f"mfsdp-train: error: {configs / 'recipe' / 'broken.yaml'}:5:")
    assert "YAML error" in lines[0]


def test_help_and_dry_run_do_not_import_torch():
    """Why they are fast: neither path imports torch (scripts/cli_latency.py measures the times)."""
    import subprocess
    import sys

    probe = ("import sys; from mfsdp_launch.launcher.cli import main; "
             "rc = main(sys.argv[1:]); assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    for args in (["--help"], ["+recipe=hfsdp_fp8", "launcher.dry_run=true", "launcher.nproc_per_node=8"]):
        out = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 0, out.stderr
