"""A CLI that teaches itself: --help names every recipe with its purpose, `+recipe=` alone names
them, Hydra's shell completion works in a real bash, --cfg shows what the planner resolves beside
what was asked, the dry run's rank table has every group (cp too), and the end-of-run line says
how many tokens trained and how many epochs of the data that is."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from helpers import ROOT, cli, cli_error, cli_env
from mfsdp_launch.launcher import cli as cli_module
from mfsdp_launch.launcher.runstate import Ending, summary_line


def recipe_purposes() -> dict:
    """Each recipe's first comment line after `# @package`, read here from the files themselves."""
    out = {}
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        comments = [ln.lstrip("#").strip() for ln in path.read_text().splitlines() if ln.startswith("#")]
        out[path.stem] = next(c for c in comments if not c.startswith("@"))
    return out


def test_help_lists_the_recipes_with_their_purpose(capsys):
    assert cli_module.main(["--help"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    purposes = recipe_purposes()
    assert len(purposes) >= 5
    for name, purpose in purposes.items():
        assert any(ln.split() == [name, *purpose.split()] for ln in lines), (name, text)
    assert "launcher=kubernetes|slurm|torchrun" in text and "--shell-completion install=bash" in text


def test_recipe_with_no_name_names_the_recipes_in_one_line():
    line = cli_error(cli("+recipe="))
    assert line == f"mfsdp-train: error: +recipe: names no recipe (allowed: {'|'.join(recipe_purposes())})"


def test_shell_completion_in_bash(tmp_path):
    """Hydra's bash completion, installed and asked by bash itself for `+recipe=cpu` and `train.st`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "mfsdp-train").write_text(f'#!/bin/sh\nexec {sys.executable} -m mfsdp_launch "$@"\n')
    (bin_dir / "mfsdp-train").chmod(0o755)
    script = """
eval "$(mfsdp-train --shell-completion install=bash)"
complete -p mfsdp-train
for line in "mfsdp-train +recipe=cpu" "mfsdp-train train.st"; do
  COMP_LINE="$line"; COMP_POINT=${#line}; COMP_CWORD=1
  hydra_bash_completion
  echo "candidates: ${COMPREPLY[*]}"
done
"""
    env = {**cli_env(), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "hydra_bash_completion mfsdp-train" in lines[0]
    assert lines[1] == "candidates: +recipe=cpu_smoke"
    assert "train.steps=" in lines[2].split() and all(w.startswith("train.st") for w in lines[2].split()[1:])


def test_cfg_shows_what_resolves_beside_what_was_asked(capsys):
    assert cli_module.main(["+recipe=cpu_smoke", "launcher.dry_run=true", "--cfg"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert "  dp_shard: -1  # resolved: 2" in lines  # 2 processes, FSDP over both
    assert "  dim: null  # resolved: 64" in lines and "  n_layers: null  # resolved: 2" in lines  # preset tiny
    assert "  preset: tiny" in lines and lines[0].startswith("# the composed config")
    asked = yaml.safe_load(text)  # still the config as asked: the notes are comments
    assert asked["mesh"]["dp_shard"] == -1 and asked["model"]["dim"] is None


def test_dry_run_rank_table_has_the_cp_group():
    out = cli("+recipe=cpu_smoke", "mesh.cp=2", "launcher.nproc_per_node=4", "launcher.dry_run=true")
    assert out.returncode == 0, out.stderr
    header = [ln.split() for ln in out.stdout.splitlines() if "dp_outer" in ln and "hsdp" in ln][0]
    assert header == ["dp_shard_cp", "dp_outer", "dp", "hsdp", "cp", "tp"]
    rows = {ln.split()[0]: ln.split() for ln in out.stdout.splitlines() if ln.split()[:1] in (["0"], ["3"])}
    assert rows["0"][-2:] == ["0-1", "0"] and rows["3"][-2:] == ["2-3", "3"]  # cp pairs, one rank per tp group


def test_end_of_run_line_says_tokens_and_epochs(tmp_path):
    end = Ending(0, 40, "step_40", loss=2.5, tokens=1_310_720, epochs=0.25)
    line = summary_line(end, 40, 12.0, tmp_path)
    assert "loss 2.5000, 1.31M tokens (0.25 epochs of the data), last checkpoint step_40" in line
    assert "tokens" not in summary_line(Ending(0, 40, None, loss=2.5), 40, 1.0, tmp_path)
