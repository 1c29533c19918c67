"""scripts/bench_peers.py without a GPU: the peers' log parsers on lines in their exact formats
(torchtitan 0.3.0 components/metrics.py; Automodel 0.7.0 recipes/llm/train_ft.py, which its CLI
app runs, and recipes/llm/benchmark.py's run_benchmark), the median
after warm-up, the --dry plan and the rows as scripts/bench.py renders them."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import bench  # noqa: E402
import bench_peers as bp  # noqa: E402

# torchtitan logs on every rank, with ANSI colours, every 5 steps (log_freq=5) and at step 1.
TT = "\n".join(
    f"[titan] 2026-11-30 14:02:{s:02d},123 - root - INFO - \x1b[31mstep: {s:2}  \x1b[32mloss: 10.12345  "
    f"\x1b[33mgrad_norm:  1.2345  \x1b[36mmemory: {mem:5.2f}GiB(21.54%)  \x1b[34mtps: {tps:,}  "
    f"\x1b[36mtflops: 331.45  \x1b[35mmfu: 33.51%\x1b[39m"
    for s, tps, mem in [(1, 2_113, 28.5), (5, 30_001, 30.1), (10, 38_400, 30.1), (15, 38_600, 30.2),
                        (20, 38_522, 30.2)]
) + "\n[titan] 2026-11-30 14:03:00,000 - root - INFO - Training completed\nrc=0 wall_s=95 flags: --training.steps 40"

# Automodel's run_benchmark loop logs on rank 0: its batch once, then per iteration.
AM_HEAD = ("2026-11-30 14:05:01 | INFO | nemo_automodel.recipes.llm.benchmark | Running 40 iterations with 10 warmup steps\n"
           "2026-11-30 14:05:01 | INFO | nemo_automodel.recipes.llm.benchmark | GA steps: 1, DP size: 2, "
           "Local batch size: 4, Global batch size: 8\n")


def am_iteration(i: int, seconds: float, mem: float = 25.12) -> str:
    p = "2026-11-30 14:05:02 | INFO | nemo_automodel.recipes.llm.benchmark | "
    return (f"{p}Rank 0 | Iteration {i}\nnum_label_tokens=16376 | loss=10.4321\n"
            f"{p}Rank 0 | Iteration {i} | num_label_tokens=16376 | Max Memory Allocated: {mem:.2f} GB | loss=10.4321\n"
            f"{p}Max iter time: {seconds:.6f} seconds\n{p}MFU: 31.123456% | FLOPs scope: text\n")


def test_torchtitan_lines_every_rank_and_step():
    samples = bp.parse_torchtitan(TT + "\n" + TT)  # two ranks
    assert len(samples) == 10 and samples[2] == (10, 38_400.0, 30.1)
    got = bp.summarize(samples)
    assert got["tokens_per_s_per_gpu"] == 38_522 and got["samples"] == 6 and got["peak_mem_gib"] == 30.2


def test_automodel_benchmark_lines_give_tokens_per_gpu():
    text = AM_HEAD + "".join(am_iteration(i, t) for i, t in [(0, 2.5), (9, 0.31), (10, 0.30), (11, 0.293), (12, 0.29)])
    samples = bp.parse_automodel(text)
    assert [s[0] for s in samples] == [0, 9, 10, 11, 12]
    got = bp.summarize(samples)
    assert got["tokens_per_s_per_gpu"] == pytest.approx(8 * 2048 / 2 / 0.293)  # median of 10..12
    assert got["samples"] == 3 and got["peak_mem_gib"] == 25.12


def am_step(step: int, per_gpu: float, mem: float = 25.10) -> str:
    return (f"2026-11-30 14:05:02 | INFO | root | step {step} | epoch 0 | loss 10.4321 | grad_norm 1.2345 | "
            f"lr 3.00e-04 | mem {mem:.2f} GiB | tps {2 * per_gpu:.2f}({per_gpu:.2f}/gpu) | num_label_tokens 16376")


def test_automodel_cli_app_tps_lines():
    """What run.sh's am_fsdp2 prints: the train_ft loop's per-step line, on rank 0."""
    text = "\n".join(am_step(s, t) for s, t in [(0, 900.0), (5, 27_000.0), (10, 27_939.0), (11, 28_100.0),
                                                (12, 27_500.0)]) + "\nrc=0 wall_s=120 strategy=fsdp2"
    samples = bp.parse_automodel(text)
    assert samples[2] == (10, 27_939.0, 25.10) and len(samples) == 5
    assert bp.summarize(samples)["tokens_per_s_per_gpu"] == 27_939.0


def test_nothing_parsed_is_none():
    assert bp.parse_torchtitan("Traceback (most recent call last):\n  RuntimeError: boom") == []
    assert bp.parse_automodel("Max iter time: 0.3 seconds") == []  # no batch line: no guess
    assert bp.summarize([]) is None


def test_dry_prints_the_interleaved_commands():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_peers.py"), "--dry", "--rounds", "2", "--world", "2"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    # (a torchtitan entry prints its one-off wheel install first)
    names = [line.split("]")[1].split(":")[0].strip() for line in lines if "pip install" not in line]
    assert names[:2] == ["tt_nocg", "mfsdp"] and names.count("tt_nocg") == 2
    eager = [line for line in lines if line.split("]")[1].startswith(" tt_nocg:") and "torchrun" in line]
    assert eager and all("--training.disable_cuda_graphs" in line and "--compile.enable" not in line for line in eager)
    assert any("run.sh am_fsdp2" in line for line in lines)
    assert any("--compile.enable" in line and "--training.disable_cuda_graphs" in line for line in lines)
    assert any("engine=fsdp2" in line and "launcher.nproc_per_node=2" in line for line in lines)
    assert any("train.compile=true" in line for line in lines)
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_peers.py"), "--dry", "--only", "nope"],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "unknown entry 'nope'" in bad.stderr


def test_rows_render_in_bench_results(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "OUT", tmp_path)
    tt = dict(bp.ENTRIES["tt_nocg"], group=bp.GROUP, kind="peer", fp8_params=False, world=2, ok=True,
              tokens_per_s_per_gpu=38_522.0, peak_mem_gib=30.2, measured_at="2026-12-06T11:20:00")
    tt["mfu"] = bp.mfu_of(tt["tokens_per_s_per_gpu"], 989.0)
    ours = dict(bp.ENTRIES["mfsdp"], group=bp.GROUP, kind="launcher", fp8_params=False, world=2, ok=True,
                tokens_per_s_per_gpu=41_828.0, mfu=0.38, peak_mem_gib=31.5, measured_at="2026-12-06T11:22:00")
    # what a device call leaves in $OUT, merged here into bench/results.json and rendered
    rows = tmp_path / "out" / bp.ROWS
    rows.parent.mkdir()
    rows.write_text(json.dumps({"device": "2x NVIDIA H200", "runs": {r["name"]: r for r in (tt, ours)}}))
    assert bp.merge([str(rows)]) == 0
    assert set(json.loads((tmp_path / "results.json").read_text())["runs"]) == {tt["name"], ours["name"]}
    md = (tmp_path / "results.md").read_text()
    assert "| peer_torchtitan_flex_nocg_1.4b_bf16_mbs4 | torchtitan 0.3.0 FSDP2 | llama 1.4b | 2048 | 4 |" in md
    assert "38,522" in md and "41,828" in md
    assert f"**{41_828 / 38_522:.3f}x**" in md
    # the same FLOP convention as the launcher's rows: 38.5k tokens/s/GPU of the 1.4B is ~35 % of 989 TF
    assert 0.30 < tt["mfu"] < 0.40


def test_merged_rows_keep_the_machine_they_ran_on(tmp_path, monkeypatch):
    """A call that got an H100 adds rows marked as such; the header keeps the H200 the others ran on."""
    monkeypatch.setattr(bench, "OUT", tmp_path)
    bench.save_results({"device": "1x NVIDIA H200", "runs": {}})
    ours = dict(bp.ENTRIES["mfsdp_compile_graph"], group=bp.GROUP, kind="launcher", fp8_params=False, world=1,
                ok=True, tokens_per_s_per_gpu=52_148.0, mfu=0.47, peak_mem_gib=47.9)
    rows = tmp_path / bp.ROWS
    rows.write_text(json.dumps({"device": "1x NVIDIA H100 80GB HBM3", "runs": {ours["name"]: ours}}))
    assert bp.merge([str(rows)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["device"] == "1x NVIDIA H200" and res["runs"][ours["name"]]["device"] == "1x NVIDIA H100 80GB HBM3"
    md = (tmp_path / "results.md").read_text()
    assert "# Throughput (1x NVIDIA H200)" in md and "| 1 (NVIDIA H100 80GB HBM3) | 52,148 |" in md


def test_every_launcher_entry_passes_validation():
    """No bench entry is refused before it spawns (the device call would be wasted)."""
    import bench_small
    from pathlib import Path

    from mfsdp_launch.planner import prepare

    ours = [e for e in bp.ENTRIES.values() if e["kind"] == "launcher"]
    small = bench_small.matrix()
    assert len(small) == 24 and {e["variant"] for e in small} == {"eager", "compile", "graph"}
    for e in ours + small:
        args = bp.launcher_overrides(e, 30, Path("/nonexistent") / e["name"], bp.world_for(e, None, 2))
        keys = [a.split("=", 1)[0] for a in args]
        assert len(keys) == len(set(keys)), args  # each override once (an entry's extras too)
        cfg, _ = prepare(args, check_hardware=False)
        assert cfg.launcher.nproc_per_node == bp.world_for(e, None, 2)
        assert cfg.train.micro_batch_size == e["mbs"]


def test_a_timed_out_run_takes_its_children_with_it(tmp_path):
    """run_group stops the whole process group (torchrun and its ranks), not only the parent."""
    import os
    import time

    pid_file = tmp_path / "child.pid"
    script = f"sleep 60 & echo $! > {pid_file}; wait"
    t0 = time.time()
    got = bp.run_group(["bash", "-c", script], 2, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert got.returncode == 124 and "timed out after 2 s" in got.stderr and time.time() - t0 < 30
    child = int(pid_file.read_text())
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the child of the timed-out run survived")


def test_small_notes_name_the_best_mfu():
    import bench_report
    import bench_small

    rows = {}
    for e, mfu in zip(bench_small.matrix()[:6], (0.08, 0.12, 0.10, 0.20, 0.27, 0.22)):
        rows[e["name"]] = dict(e, ok=True, mfu=mfu, tokens_per_s_per_gpu=1000 * mfu)
    notes = bench_report.small_notes(rows)
    assert notes == ["- gpt 125m on 1 GPU(s): mbs 4 eager 8.0% -> best small_mfsdp_gpt_125m_mbs16_compile_g1 "
                     "**27.0% MFU** (270 tokens/s/GPU; goal >= 25%)"]
