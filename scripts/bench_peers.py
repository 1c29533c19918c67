"""Peers bench: torchtitan 0.3.0 and NeMo Automodel 0.7.0 next to this launcher (both engines), in
one device call, interleaved, on the same 1.4B Llama (dim 2048, 24 layers, 16 heads, ffn 5632,
vocab 32000 untied), seq 2048, micro-batch 4 per GPU, bf16 compute / fp32 reduce, FSDP over every
GPU of the machine (`--world N` overrides; the MoE slice entries pin one GPU unless --world says).

The peers come from ../shared/peers/ staged into the git-ignored `.peers/` (its prepare.sh; see
its README). torchtitan's modes run through the kit's own `run.sh` (flex_nocg, ...); the compile
variant, which run.sh lacks, runs torchtitan exactly as run.sh's `tt` function does, plus
`--compile.enable`. Each run's log lands in --logs; tokens/s/GPU is the median after warm-up
(steps >= 10: FlexAttention autotuning, CUDA warm-up), parsed from the peers' own log lines.
Rows merge into bench/results.json (scripts/bench.py's format) and bench/results.md /
throughput.png are re-rendered through scripts/bench.py's `render`.

  python3 scripts/bench_peers.py --dry                  # the commands, in order; runs nothing
  python3 scripts/bench_peers.py                        # all six entries, one round (~12 min)
  python3 scripts/bench_peers.py --only tt_compile      # one entry by its short name
  python3 scripts/bench_peers.py --world 2              # on 2 of the machine's GPUs
  python3 scripts/bench_peers.py --profile 20           # also trace step 20 of each run: <name>.ops.txt
  python3 scripts/bench_peers.py --merge OUT/peers_rows.json   # here: merge a device call's rows, render

On the device only $OUT comes back, so each run also writes its rows to $OUT/peers_rows.json
(next to the logs); `--merge` puts them into bench/results.json on this machine.

On the 2-GPU machine, back to back (it is given back ~30 s after a call; /tmp lives while it is held):
  1. carry [".devkit", ".te0"]: bash .devkit/setup.sh base                  (megatron-fsdp + hydra)
  2. carry [".peers"], ~5-6 min: source /tmp/devkit/env.sh; python3 scripts/bench_peers.py
       --only tt_nocg --only mfsdp --only am_fsdp2 --only fsdp2
  3. carry [".peers"], ~6-8 min: source /tmp/devkit/env.sh; python3 scripts/bench_peers.py
       --tag _call2 --only tt_compile --only mfsdp_compile --only tt_nocg --only mfsdp
  then here: python3 scripts/bench_peers.py --merge FILES_AT_2/peers_rows.json FILES_AT_3/peers_rows.json
(one device command may run 10 minutes, so the six entries are split over two calls, each interleaved.)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))  # mfsdp_launch from this checkout
import bench  # noqa: E402  (scripts/bench.py: launcher_args, run_launcher, results.json, render)
from mfsdp_launch.core.hardware import local_gpu_count  # noqa: E402

KIT = ROOT / ".peers"
SEQ, MBS = 2048, 4
STEPS = 40
WARMUP = 10  # samples from steps/iterations >= this count
GROUP = "peers"
ROWS = "peers_rows.json"
LLAMA = dict(model="llama", preset="1.4b", seq=SEQ, mbs=MBS, precision="bf16")

# short name -> the row it writes. kind: run_sh (a run.sh mode), tt (torchtitan with extra flags),
# launcher (python -m mfsdp_launch through scripts/bench.py). Listed in the interleaved order.
ENTRIES: Dict[str, dict] = {
    # run.sh's flex_nocg mode, run as its `tt` function does (so --profile can add torchtitan's flags)
    "tt_nocg": dict(name="peer_torchtitan_flex_nocg_1.4b_bf16_mbs4", kind="tt", flags=["--training.disable_cuda_graphs"],
                    log="tt_flex_nocg.log", parser="torchtitan", engine="torchtitan 0.3.0 FSDP2", **LLAMA),
    "mfsdp": dict(name="peers_mfsdp_gpt_1.4b_bf16_mbs4", kind="launcher", engine="megatron_fsdp",
                  **dict(LLAMA, model="gpt")),
    "am_fsdp2": dict(name="peer_automodel_fsdp2_1.4b_bf16_mbs4", kind="run_sh", mode="am_fsdp2",
                     log="am_fsdp2.log", parser="automodel", engine="Automodel 0.7.0 fsdp2",
                     **dict(LLAMA, model="hf llama")),
    "fsdp2": dict(name="peers_fsdp2_gpt_1.4b_bf16_mbs4", kind="launcher", engine="fsdp2",
                  **dict(LLAMA, model="gpt")),
    "tt_compile": dict(name="peer_torchtitan_compile_nocg_1.4b_bf16_mbs4", kind="tt",
                       flags=["--training.disable_cuda_graphs", "--compile.enable"], log="tt_compile_nocg.log",
                       parser="torchtitan", engine="torchtitan 0.3.0 FSDP2 + compile", **LLAMA),
    "mfsdp_compile": dict(name="peers_mfsdp_gpt_1.4b_bf16_mbs4_compile", kind="launcher", engine="megatron_fsdp",
                          extra=["train.compile=true"], **dict(LLAMA, model="gpt")),
    # On one GPU nothing needs sharding (torchtitan 0.3.0 still applies FSDP2 at shard degree 1, for
    # its mixed-precision policy). Megatron-FSDP's ZeRO-3 copies each gradient into a bucket,
    # reduce-scatters it over the one rank and adds it into its buffer; ZeRO-0 (no_shard) adds it
    # into the buffer directly and skips the per-block unshard/reshard. One H100 (session 29): 0.98x
    # mfsdp_compile in the same call, so ZeRO-3 stays the default.
    "mfsdp_compile_z0": dict(name="peers_mfsdp_gpt_1.4b_bf16_mbs4_compile_z0", kind="launcher", engine="megatron_fsdp",
                             extra=["train.compile=true"], zero=0, init_on_meta=False, **dict(LLAMA, model="gpt")),
    # mfsdp_compile with optim.impl=triton (components/fused_adamw.py) reading the bf16 main gradients
    # where Megatron-FSDP reduced them: at one micro-batch on one GPU they hold what autograd produced
    # (torchtitan's fp32 reduction over one rank only widens the same bf16 values), and each step moves
    # ~10 bytes a parameter less through the gradient buffer, its fill, the clip's norm and the update.
    # One H100, session 36: 54,879 / 54,829 / 55,044 against mfsdp_compile's 52,551 / 52,613 / 52,669 and
    # tt_compile's 45,418 / 45,389 (1.208x); eager (mfsdp_triton) 50,240 against tt_nocg's 41,475 (1.211x).
    "mfsdp_compile_triton": dict(name="peers_mfsdp_gpt_1.4b_bf16_mbs4_compile_triton", kind="launcher",
                                 engine="megatron_fsdp",
                                 grads="bf16", extra=["train.compile=true", "optim.impl=triton",
                                                      "engine.use_decoupled_grad=true"], **dict(LLAMA, model="gpt")),
    "mfsdp_triton": dict(name="peers_mfsdp_gpt_1.4b_bf16_mbs4_triton", kind="launcher", engine="megatron_fsdp",
                         grads="bf16", extra=["optim.impl=triton", "engine.use_decoupled_grad=true"],
                         **dict(LLAMA, model="gpt")),
    # issue 27 goal 3 (60 % MFU): twice the micro-batch, compiled, with and without a full-iteration graph.
    # One H100, session 36: 59,688 (54.3 % MFU) and 59,530 (54.2 %): the graph saves nothing.
    "mfsdp_compile_triton_mbs8": dict(name="peers_mfsdp_gpt_1.4b_bf16_mbs8_compile_triton", kind="launcher",
                                      engine="megatron_fsdp", grads="bf16",
                                      extra=["train.compile=true", "optim.impl=triton", "engine.use_decoupled_grad=true"],
                                      **dict(LLAMA, model="gpt", mbs=8)),
    "mfsdp_compile_triton_graph_mbs8": dict(name="peers_mfsdp_gpt_1.4b_bf16_mbs8_compile_triton_graph",
                                            kind="launcher", engine="megatron_fsdp", grads="bf16",
                                            extra=["train.compile=true", "optim.impl=triton",
                                                   "engine.use_decoupled_grad=true", "train.cuda_graph=full_iteration"],
                                            **dict(LLAMA, model="gpt", mbs=8)),
    # Our best settings against torchtitan's best (compile): twice the micro-batch fits easily (50 GiB).
    "mfsdp_compile_mbs8": dict(name="peers_mfsdp_gpt_1.4b_bf16_mbs8_compile", kind="launcher",
                               engine="megatron_fsdp", extra=["train.compile=true"], **dict(LLAMA, model="gpt", mbs=8)),
    # A full-iteration CUDA graph over the compiled blocks: one replay a step launches forward,
    # loss, backward and the engine's reduction, so no host Python (Megatron-FSDP's hooks, Dynamo's
    # guards) runs between them. One H100: 0.99x mfsdp_compile (sessions 28 and 29), whose step
    # already keeps that GPU busy; the H200 pair is not measured. torchtitan's own CUDA graphs cannot run on this
    # torch (tt_bench.py says why), so its best here is tt_compile.
    "mfsdp_compile_graph": dict(name="peers_mfsdp_gpt_1.4b_bf16_mbs4_compile_graph", kind="launcher",
                                engine="megatron_fsdp", extra=["train.compile=true", "train.cuda_graph=full_iteration"],
                                **dict(LLAMA, model="gpt")),
    "mfsdp_graph": dict(name="peers_mfsdp_gpt_1.4b_bf16_mbs4_graph", kind="launcher", engine="megatron_fsdp",
                        extra=["train.cuda_graph=full_iteration"], **dict(LLAMA, model="gpt")),
    "mfsdp_compile_graph_mbs8": dict(name="peers_mfsdp_gpt_1.4b_bf16_mbs8_compile_graph", kind="launcher",
                                     engine="megatron_fsdp",
                                     extra=["train.compile=true", "train.cuda_graph=full_iteration"],
                                     **dict(LLAMA, model="gpt", mbs=8)),
}
# Issue 24 on ONE H200: torchtitan's own Qwen3-30B-A3B cut to 4 layers (bench/peers/tt_qwen3_moe.py, the
# same 3,114,814,464 parameters) against our model.preset=qwen3-30b-a3b model.n_layers=4, eager and
# compiled, and our dense gpt of equal active parameters (the MoE layers' 8 x 768 -> one SwiGLU of 6144).
# Goal: >= 1.15x torchtitan's tokens/s/GPU. `--only tt_moe --only moe --only tt_moe_compile --only moe_compile
# --only moe_fsdp2 --only moe_dense_twin` (about 8 minutes).
MOE = dict(model="qwen3 moe", preset="qwen3-30b-a3b", n_layers=4, seq=4096, mbs=2, precision="bf16", world=1)
TT_MOE = dict(kind="tt", module="tt_qwen3_moe", config="qwen3_30b_a3b_slice", parser="torchtitan", **MOE)
ENTRIES.update({
    "tt_moe": dict(name="peer_torchtitan_qwen3moe_l4_bf16_mbs2", flags=["--training.disable_cuda_graphs"],
                   log="tt_moe.log", engine="torchtitan 0.3.0 FSDP2", **TT_MOE),
    "moe": dict(name="peers_mfsdp_qwen3moe_l4_bf16_mbs2", kind="launcher", engine="megatron_fsdp",
                **dict(MOE, model="gpt")),
    "tt_moe_compile": dict(name="peer_torchtitan_qwen3moe_l4_bf16_mbs2_compile", log="tt_moe_compile.log",
                           flags=["--training.disable_cuda_graphs", "--compile.enable"],
                           engine="torchtitan 0.3.0 FSDP2 + compile", **TT_MOE),
    "moe_compile": dict(name="peers_mfsdp_qwen3moe_l4_bf16_mbs2_compile", kind="launcher", engine="megatron_fsdp",
                        extra=["train.compile=true"], **dict(MOE, model="gpt")),
    "moe_fsdp2": dict(name="peers_fsdp2_qwen3moe_l4_bf16_mbs2", kind="launcher", engine="fsdp2",
                      **dict(MOE, model="gpt")),
    # FSDP2 as torchtitan runs it: one micro-batch copies each gradient once, where Megatron-FSDP
    # zeroes its fp32 gradient buffer and adds into it (session 22's trace: ~15 ms of a 141 ms step)
    "moe_fsdp2_compile": dict(name="peers_fsdp2_qwen3moe_l4_bf16_mbs2_compile", kind="launcher", engine="fsdp2",
                              extra=["train.compile=true"], **dict(MOE, model="gpt")),
    "moe_dense_twin": dict(name="peers_mfsdp_qwen3dense_l4_bf16_mbs2", kind="launcher", engine="megatron_fsdp",
                           extra=["model.moe.experts=0"], **dict(MOE, model="gpt")),
})
# Issue 26 on ONE GPU: torchao float8 rowwise against bf16, both compiled, on Llama-3 8B's first 8
# layers at seq 8192 (mbs 1), torchtitan's own 8B (bench/peers/tt_llama3_8b_slice.py, its
# Float8LinearConverter) next to our gpt 8b slice under FSDP2 (bench/matrix.yaml's torchao_fp8
# group, as peers). The head stays bf16 in torchtitan's rows and in ao8b_rowwise; ao8b_rowwise_head
# puts it in FP8 too, compiled on its own (models/compile.py's `also`). `--only tt_8b --only ao8b
# --only tt_8b_rowwise --only ao8b_rowwise --only ao8b_rowwise_head` (about 8 minutes).
SLICE_8B = dict(preset="8b", n_layers=8, seq=8192, mbs=1, world=1)
TT_8B = dict(kind="tt", module="tt_llama3_8b_slice", parser="torchtitan", model="llama3",
             flags=["--training.disable_cuda_graphs", "--compile.enable"], engine="torchtitan 0.3.0 FSDP2 + compile",
             **SLICE_8B)
OURS_8B = dict(kind="launcher", model="gpt", engine="fsdp2", **SLICE_8B)
ENTRIES.update({
    "tt_8b": dict(name="peer_torchtitan_8b_l8_s8192_bf16_compile", config="llama3_8b_slice", log="tt_8b.log",
                  precision="bf16", **TT_8B),
    "tt_8b_rowwise": dict(name="peer_torchtitan_8b_l8_s8192_rowwise_compile", config="llama3_8b_slice_rowwise",
                          log="tt_8b_rowwise.log", precision="torchao_rowwise", **TT_8B),
    "ao8b": dict(name="peers_fsdp2_gpt_8b_l8_s8192_bf16_compile", precision="bf16", extra=["train.compile=true"],
                 **OURS_8B),
    "ao8b_rowwise": dict(name="peers_fsdp2_gpt_8b_l8_s8192_rowwise_compile", precision="torchao_rowwise",
                         extra=["train.compile=true", "fp8.skip=[lm_head]"], **OURS_8B),
    "ao8b_rowwise_head": dict(name="peers_fsdp2_gpt_8b_l8_s8192_rowwise_compile_head", precision="torchao_rowwise",
                              extra=["train.compile=true"], **OURS_8B),
})
DEFAULT = ["tt_nocg", "mfsdp", "am_fsdp2", "fsdp2", "tt_compile", "mfsdp_compile"]

ANSI = re.compile(r"\x1b\[[0-9;]*m")
# torchtitan components/metrics.py: "step: 10  loss: ...  memory: 30.12GiB(21.5%)  tps: 38,522  tflops: ..."
TT_LINE = re.compile(r"step:\s*(\d+)\s.*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)")
# Automodel through its CLI app (`nemo_automodel.cli.app`, what run.sh starts) runs the recipe's
# inherited train_ft loop, which logs on rank 0 (recipes/llm/train_ft.py):
#   "step 12 | epoch 0 | loss 10.4321 | grad_norm 1.2345 | lr 3.00e-04 | mem 25.10 GiB | tps 55878.00(27939.00/gpu) | ..."
AM_TPS = re.compile(r"step (\d+) \|.*?mem ([\d.]+) GiB \| tps [\d.]+\(([\d.]+)/gpu\)")
# Its run_benchmark() loop (recipes/llm/benchmark.py) logs instead "Rank 0 | Iteration 12 | ...
# Max Memory Allocated: 25.1 GB ...", then "Max iter time: 0.293 seconds", and its batch once as
# "... Global batch size: 8"; read too, in case a version routes the CLI there.
AM_ITER = re.compile(r"Iteration (\d+)\b(?:.*?Max Memory Allocated:\s*([\d.]+) GB)?")
AM_TIME = re.compile(r"Max iter time:\s*([\d.]+) seconds")
AM_GBS = re.compile(r"Global batch size:\s*(\d+)")
AM_DP = re.compile(r"DP size:\s*(\d+)")

Sample = Tuple[int, float, Optional[float]]  # (step, tokens/s/GPU, memory GiB or None)


def parse_torchtitan(text: str) -> List[Sample]:
    """torchtitan's metrics lines (every rank logs them; all are kept)."""
    out = []
    for line in ANSI.sub("", text).splitlines():
        m = TT_LINE.search(line)
        if m:
            out.append((int(m.group(1)), float(m.group(3).replace(",", "")), float(m.group(2))))
    return out


def parse_automodel(text: str, seq_len: int = SEQ, world: Optional[int] = None) -> List[Sample]:
    """Automodel's `tps X(Y/gpu)` lines (Y is tokens/s/GPU); or, from its run_benchmark loop,
    global batch x seq / world / max iteration time (the slowest rank's). `world`: the GPUs it ran
    on; None: the DP size its log states (tp = cp = 1 here)."""
    text = ANSI.sub("", text)
    gbs = AM_GBS.search(text)
    if world is None:
        dp = AM_DP.search(text)
        world = int(dp.group(1)) if dp else None
    out, it, mem = [], None, None
    for line in text.splitlines():
        m = AM_TPS.search(line)
        if m:
            out.append((int(m.group(1)), float(m.group(3)), float(m.group(2))))
            continue
        m = AM_ITER.search(line)
        if m:
            it = int(m.group(1))
            mem = float(m.group(2)) if m.group(2) else mem
            continue
        m = AM_TIME.search(line)
        if m and it is not None and gbs and world:
            out.append((it, int(gbs.group(1)) * seq_len / world / float(m.group(1)), mem))
    return out


def summarize(samples: List[Sample], warmup: int = WARMUP) -> Optional[dict]:
    """Median tokens/s/GPU over steps >= warmup (all samples if none is that late); max memory."""
    if not samples:
        return None
    late = [s for s in samples if s[0] >= warmup] or samples
    mems = [s[2] for s in samples if s[2] is not None]
    return dict(tokens_per_s_per_gpu=statistics.median(s[1] for s in late), samples=len(late),
                peak_mem_gib=max(mems) if mems else None)


def mfu_of(tokens_per_s_per_gpu: float, peak_tflops: Optional[float], preset: str = "1.4b",
           n_layers: Optional[int] = None, seq: int = SEQ) -> Optional[float]:
    """The launcher's FLOP convention (6N + 12·L·d·T, N the active parameters for a MoE) for the
    entry's own model (the 1.4b, or the MoE slice), so a peer's row compares with ours."""
    if not peak_tflops:
        return None
    from types import SimpleNamespace

    from mfsdp_launch.models.llama.dims import flops_per_token, resolve_gpt_dims

    dims = resolve_gpt_dims(SimpleNamespace(preset=preset, n_layers=n_layers, norm_eps=1e-5, rope_theta=10000.0))
    return flops_per_token(dims, seq) * tokens_per_s_per_gpu / (peak_tflops * 1e12)


# --- the peers' commands ------------------------------------------------------------------------------


def world_for(e: dict, override: Optional[int], machine: int) -> int:
    """The GPUs entry `e` runs on: --world when given, else the entry's own (the MoE slice pins one
    H200), else every GPU of the machine (at least one: a dry plan on a machine without any)."""
    return int(override or e.get("world") or max(machine, 1))


def peer_env(kit: Path, logs: Path) -> dict:
    """run.sh's environment (NVLink multicast off, offline hubs) and $OUT for its logs."""
    env = dict(os.environ, OUT=str(logs), NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               WANDB_MODE="disabled")
    return env


def tt_install_command(kit: Path) -> List[str]:
    """run.sh installs torchtitan's wheels into /tmp/ttsite on its first tt call; the same here, and
    the kit's torchao (its Automodel wheels' copy) for torchtitan's float8 converter."""
    pip = "python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ttsite"
    kit_q = shlex.quote(str(kit))
    return ["bash", "-c", f"{{ [ -d /tmp/ttsite/torchtitan ] || {pip} {kit_q}/whl/*.whl; }} && "
            f"{{ [ -d /tmp/ttsite/torchao ] || {pip} {kit_q}/amwhl/torchao-*.whl; }}"]


def tt_command(kit: Path, e: dict, steps: int = STEPS) -> List[str]:
    """run.sh's `tt` function: torchrun over tt_launch.py with the tt_bench config, plus e's flags."""
    return ["torchrun", "--standalone", f"--nproc-per-node={e['world']}", str(kit / "tt_launch.py"),
            "--module", e.get("module", "tt_bench"), "--config", e.get("config", "llama_1p4b_bench"),
            "--training.steps", str(steps), *e["flags"]]


def commands(e: dict, kit: Path, logs: Path, launcher_steps: int) -> List[List[str]]:
    """`e` with its "world" resolved (world_for): run.sh takes it as NPROC (and scales Automodel's
    global batch to 4 per GPU), torchrun and the launcher as their process count."""
    if e["kind"] == "run_sh":
        return [["env", f"NPROC={e['world']}", "bash", str(kit / "run.sh"), e["mode"]]]
    if e["kind"] == "tt":
        return [tt_install_command(kit), tt_command(kit, e)]
    return [[sys.executable, "-m", "mfsdp_launch",
             *launcher_overrides(e, launcher_steps, logs / e["name"], e["world"])]]


def row_name(short: str, round_: int, a) -> str:
    """The results row of entry `short` in round `round_`: a profiled run's name ends in _prof, so
    its slower tokens/s never replaces the unprofiled row of the same entry in bench/results.json."""
    name = ENTRIES[short]["name"] + (f"_round{round_}" if a.rounds > 1 else "")
    return name + ("_prof" if a.profile else "") + a.tag


def with_profile(e: dict, step: int) -> dict:
    """`e` with one step (`step`, >= 4) traced by torch.profiler: torchtitan's profiler flags (it
    warms up 3 steps, then records 1), the launcher's train.profile. run.sh modes stay as they are."""
    if e["kind"] == "tt":
        return dict(e, flags=[*e["flags"], "--profiler.enable_profiling", "--profiler.profile_freq", str(step)])
    if e["kind"] == "launcher":
        return dict(e, extra=[*e.get("extra", []), f"train.profile={{start: {step}, steps: 1}}"])
    return e


TT_RUNS = Path("/tmp/ttrun")  # torchtitan's working folder, as the kit's run.sh has it


def tt_dump(e: dict) -> Path:
    """Where torchtitan writes a run of `e` (its TT_DUMP: traces, config), one folder per log."""
    return TT_RUNS / Path(e["log"]).stem


def trace_of(e: dict, logs: Path, step: int) -> Optional[Path]:
    """The rank-0 chrome trace of step `step` that a profiled run of `e` wrote, if any (torchtitan
    traces every profile_freq-th step: profiling/traces/iteration_N/rank0_trace.json.gz)."""
    if e["kind"] == "launcher":
        found = sorted((logs / e["name"] / "profile").glob("trace_rank0.json*"))
    else:
        found = sorted(tt_dump(e).glob(f"**/iteration_{step}/rank0_trace.json*"))
    return found[0] if found else None


def write_profile(e: dict, logs: Path, step: int) -> Optional[str]:
    """scripts/trace_summary.py's table of `e`'s traced step, as <name>.ops.txt in `logs`."""
    import trace_summary

    trace = trace_of(e, logs, step)
    if trace is None:
        return None
    table = trace_summary.render(trace_summary.summarize(trace_summary.gpu_kernels(trace_summary.load_events(trace))),
                                 e["name"])
    out = logs / f"{e['name']}.ops.txt"
    out.write_text(table + "\n")
    return str(out)


def launcher_overrides(e: dict, steps: int, run_dir: Path, world: int) -> List[str]:
    return bench.launcher_args(e, world, steps, 5, run_dir)  # (it appends the entry's "extra" overrides)


def run_group(cmd: List[str], timeout: int, **kw) -> subprocess.CompletedProcess:
    """subprocess.run in its own process group: on timeout the whole group (torchrun and its
    ranks) is stopped, so nothing of a timed-out run holds a GPU during the next one. rc 124."""
    proc = subprocess.Popen(cmd, start_new_session=True, **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                out, err = proc.communicate(timeout=15)
                break
            except subprocess.TimeoutExpired:
                out, err = None, None
        return subprocess.CompletedProcess(cmd, 124, out or "", (err or "") + f"\ntimed out after {timeout} s")


def run_peer(e: dict, kit: Path, logs: Path, timeout: int) -> dict:
    t0 = time.time()
    env = peer_env(kit, logs)
    env.update(T_NOCG=str(timeout), T_AM=str(timeout), T_CG=str(timeout))  # run.sh's per-mode limits
    log_path = logs / e["log"]
    rc = 0
    if e["kind"] == "run_sh":
        rc = run_group(commands(e, kit, logs, 0)[0], timeout + 60, cwd=ROOT, env=env).returncode
    else:
        install, cmd = commands(e, kit, logs, 0)
        env["PYTHONPATH"] = f"/tmp/ttsite:{kit}:{ROOT / 'bench' / 'peers'}"  # (our torchtitan config modules)
        env["TT_DUMP"] = str(tt_dump(e))
        TT_RUNS.mkdir(exist_ok=True)
        subprocess.run(install, env=env, check=True)
        with open(log_path, "w") as f:
            rc = run_group(cmd, timeout, cwd=TT_RUNS, env=env, stdout=f, stderr=subprocess.STDOUT).returncode
            f.flush()
            f.write(f"rc={rc} wall_s={time.time() - t0:.0f} flags: {' '.join(e['flags'])}\n")
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    samples = parse_automodel(text, world=e["world"]) if e["parser"] == "automodel" else parse_torchtitan(text)
    got = summarize(samples)
    row = {k: v for k, v in e.items() if k not in ("flags", "mode", "parser")}
    row.update(group=GROUP, kind="peer", fp8_params=False, world=e["world"], wall_s=round(time.time() - t0, 1),
               log=str(log_path))
    if got is None:
        return dict(row, ok=False, error=f"no throughput lines in {log_path.name} (exit {rc}): " + text[-600:])
    return dict(row, ok=True, **got)


def run_ours(e: dict, steps: int, logs: Path, log, world: int, group: str = GROUP,
             timeout: int = 400) -> dict:
    """A launcher row as scripts/bench.py's run_launcher makes it (medians of metrics.jsonl after the
    first row), with this entry's extra overrides (train.compile=true)."""
    run_dir = logs / e["name"]  # its metrics.jsonl and rank logs come back with the peers' logs
    cmd = [sys.executable, "-m", "mfsdp_launch", *launcher_overrides(e, steps, run_dir, world)]
    t0 = time.time()
    proc = run_group(cmd, timeout, cwd=ROOT, env=bench._env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     text=True)
    log.write(f"\n=== {e['name']} ({time.time() - t0:.0f} s, exit {proc.returncode})\n$ {shlex.join(cmd)}\n"
              f"{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}\n")
    log.flush()
    row = dict(e, group=group, kind="launcher", fp8_params=False, world=world)
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    if proc.returncode != 0 or not rows:
        return dict(row, ok=False, error=(proc.stderr or proc.stdout)[-800:])
    use = rows[1:] or rows
    mfu = statistics.median(r["mfu"] for r in use) if use[0]["mfu"] is not None else None
    return dict(row, ok=True, tokens_per_s_per_gpu=statistics.median(r["tokens_per_s_per_gpu"] for r in use),
                mfu=mfu, peak_mem_gib=max(r["peak_mem_gib"] for r in rows),
                step_time_s=statistics.median(r["step_time_s"] for r in use), loss=rows[-1]["loss"],
                rows=len(rows), wall_s=round(time.time() - t0, 1))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", action="append", default=[], help=f"short names: {', '.join(ENTRIES)}")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the interleaved sequence")
    ap.add_argument("--steps", type=int, default=STEPS, help="launcher steps (the peers run 40)")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per peer run")
    ap.add_argument("--kit", default=str(KIT))
    ap.add_argument("--logs", default=os.environ.get("OUT", str(bench.OUT / "peers_logs")))
    ap.add_argument("--tag", default="", help="suffix for the row names (keeps rows of separate calls apart)")
    ap.add_argument("--world", type=int, default=None,
                    help="GPUs for every entry (default: the machine's GPU count; the MoE slice entries: 1)")
    ap.add_argument("--profile", type=int, default=0, metavar="STEP",
                    help="trace step STEP (>= 4) of each torchtitan and launcher run; <name>.ops.txt in --logs "
                         "says where its GPU time went (scripts/trace_summary.py)")
    ap.add_argument("--dry", action="store_true", help="print the commands; run nothing")
    ap.add_argument("--merge", nargs="+", help="peers_rows.json files from device calls: merge and render")
    a = ap.parse_args(argv)
    if a.merge:
        return merge(a.merge)
    unknown = [n for n in a.only if n not in ENTRIES]
    if unknown:
        print(f"bench_peers: unknown entry {unknown[0]!r} (allowed: {', '.join(ENTRIES)})", file=sys.stderr)
        return 2
    if a.world is not None and a.world < 1:
        print(f"bench_peers: --world must be >= 1, got {a.world}", file=sys.stderr)
        return 2
    if a.profile and not 4 <= a.profile <= min(STEPS, a.steps):
        print(f"bench_peers: --profile must be a step in 4..{min(STEPS, a.steps)}, got {a.profile}", file=sys.stderr)
        return 2
    names = a.only or DEFAULT
    kit, logs = Path(a.kit), Path(a.logs)
    machine = local_gpu_count()  # torch-free: the driver's GPU list, CUDA_VISIBLE_DEVICES
    if a.dry and not machine and a.world is None:
        print("bench_peers: no GPU here: the plan is for 1 GPU per entry (--world N plans for N)", file=sys.stderr)
    plan = [(r, n, world_for(ENTRIES[n], a.world, machine)) for r in range(1, a.rounds + 1) for n in names]
    if a.dry:
        for r, n, world in plan:
            e = dict(ENTRIES[n], world=world)
            e = with_profile(e, a.profile) if a.profile else e
            for cmd in commands(e, kit, logs, a.steps):
                print(f"[round {r}] {n}: {shlex.join(cmd)}")
        return 0
    if not (kit / "run.sh").exists():
        print(f"bench_peers: {kit}/run.sh missing: run ../shared/peers/prepare.sh and carry .peers",
              file=sys.stderr)
        return 2
    return run_plan(plan, kit, logs, a)


def run_plan(plan, kit: Path, logs: Path, a) -> int:
    import torch

    from mfsdp_launch.core.hardware import peak_tflops_for

    need = max(world for _, _, world in plan)
    if torch.cuda.device_count() < need:
        print(f"bench_peers: needs {need} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 1
    device = torch.cuda.get_device_name(0)
    peak = peak_tflops_for(device)
    logs.mkdir(parents=True, exist_ok=True)
    res = bench.load_results()
    res["device"] = f"{torch.cuda.device_count()}x {device}"
    rows: Dict[str, dict] = {}
    with open(logs / "launcher.log", "a") as log:
        for r, n, world in plan:
            e = dict(ENTRIES[n], world=world, name=row_name(n, r, a))
            e = with_profile(e, a.profile) if a.profile else e
            if e["kind"] == "launcher":
                row = run_ours(e, a.steps, logs, log, world=world, timeout=a.timeout + 120)
            else:
                row = run_peer(e, kit, logs, a.timeout)
                if row.get("ok"):
                    row["mfu"] = mfu_of(row["tokens_per_s_per_gpu"], peak, e.get("preset", "1.4b"),
                                        e.get("n_layers"), e.get("seq", SEQ))
            row["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
            if a.profile:
                row["profile_step"], row["profile_ops"] = a.profile, write_profile(e, logs, a.profile)
            res["runs"][row["name"]] = row
            bench.save_results(res)
            rows[row["name"]] = row
            (logs / ROWS).write_text(json.dumps({"device": res["device"], "runs": rows}, indent=1, sort_keys=True))
            tps = f"{row['tokens_per_s_per_gpu']:,.0f} tok/s/GPU" if row.get("ok") else "FAILED"
            print(f"[round {r}] {n}: {row['name']}: {tps} ({row.get('wall_s', '?')} s)", flush=True)
            if not row.get("ok"):
                print("   " + str(row.get("error", ""))[-600:].replace("\n", "\n   "), flush=True)
    bench.render(res)
    return 0


def merge(paths: List[str]) -> int:
    """Rows written on the device ($OUT/peers_rows.json, small_rows.json) into bench/results.json;
    then render."""
    res = bench.load_results()
    for path in paths:
        got = json.loads(Path(path).read_text())
        # Each row keeps the machine it ran on: a call may get an H100 where the rest ran on H200s,
        # and results.md marks such rows (the header names the machine of the others).
        res["runs"].update({name: dict(row, device=row.get("device", got.get("device")))
                            for name, row in got["runs"].items()})
        res.setdefault("device", got.get("device"))
        print(f"merged {len(got['runs'])} row(s) from {path}")
    bench.save_results(res)
    bench.render(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
