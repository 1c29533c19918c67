"""scripts/bench_peers.py at the machine's GPU count (issue 27, goal 2): every entry runs on all
GPUs unless `--world N` says otherwise or the entry pins its own (the one-H200 MoE slice), and the
peers follow: run.sh's NPROC, torchtitan's torchrun, the launcher's nproc_per_node, Automodel's
tokens/s/GPU. In process: the --dry plan and the pure parts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import bench_peers as bp  # noqa: E402


def test_world_for_each_entry():
    llama, moe = bp.ENTRIES["mfsdp"], bp.ENTRIES["moe"]
    assert bp.world_for(llama, None, 8) == 8 and bp.world_for(llama, None, 1) == 1
    assert bp.world_for(llama, None, 0) == 1  # a dry plan on a machine without a GPU
    assert bp.world_for(moe, None, 8) == 1  # the MoE slice is the one-H200 benchmark
    assert bp.world_for(llama, 2, 8) == 2 and bp.world_for(moe, 4, 8) == 4  # --world wins


def test_the_dry_plan_runs_every_tool_at_the_world(capsys):
    assert bp.main(["--dry", "--world", "4", "--only", "tt_nocg", "--only", "am_fsdp2", "--only", "tt_compile",
                    "--only", "mfsdp", "--only", "moe"]) == 0
    lines = capsys.readouterr().out.splitlines()
    by = {}
    for line in lines:
        by.setdefault(line.split("]")[1].split(":")[0].strip(), []).append(line)
    assert all("env NPROC=4 bash" in line for line in by["am_fsdp2"])
    assert "--nproc-per-node=4" in by["tt_compile"][-1] and "--nproc-per-node=4" in by["tt_nocg"][-1]
    assert "launcher.nproc_per_node=4" in by["mfsdp"][0] and "launcher.nproc_per_node=4" in by["moe"][0]
    assert bp.main(["--dry", "--world", "0"]) == 2
    assert "--world must be >= 1, got 0" in capsys.readouterr().err


def test_commands_follow_the_world(tmp_path):
    kit = Path("/kit")
    e = dict(bp.ENTRIES["tt_compile"], world=8)
    assert bp.tt_command(kit, e)[:3] == ["torchrun", "--standalone", "--nproc-per-node=8"]
    run_sh = bp.commands(dict(bp.ENTRIES["am_fsdp2"], world=8), kit, tmp_path, 40)
    assert run_sh == [["env", "NPROC=8", "bash", "/kit/run.sh", "am_fsdp2"]]
    ours = bp.commands(dict(bp.ENTRIES["fsdp2"], world=8), kit, tmp_path, 40)[0]
    assert "launcher.nproc_per_node=8" in ours and "engine=fsdp2" in ours


def test_automodel_benchmark_lines_divide_by_the_world():
    """run_benchmark's lines give the global batch and the slowest rank's time: tokens/s/GPU divides
    by the GPUs it ran on (given, or the DP size its log states; neither: no guess)."""
    head = "Running 40 iterations\nGA steps: 1, DP size: 8, Local batch size: 4, Global batch size: 32\n"
    body = "".join(f"Rank 0 | Iteration {i} | Max Memory Allocated: 25.00 GB\nMax iter time: 0.5 seconds\n"
                   for i in range(10, 13))
    expect = 32 * bp.SEQ / 8 / 0.5
    assert bp.summarize(bp.parse_automodel(head + body))["tokens_per_s_per_gpu"] == pytest.approx(expect)
    assert bp.summarize(bp.parse_automodel(head + body, world=8))["tokens_per_s_per_gpu"] == pytest.approx(expect)
    no_dp = head.replace("DP size: 8, ", "")
    assert bp.parse_automodel(no_dp + body) == []
