"""Throughput benchmark: engine x model size x micro-batch x precision, on the GPUs present.

Each launcher entry is a real `python -m mfsdp_launch ...` run (synthetic data, no checkpoint
save); tokens/s/GPU and MFU are the medians of its metrics.jsonl rows after the first (warm-up)
row, peak memory the max. "bare" entries run scripts/bare_loop.py (no launcher) under torchrun
in the same call, as the reference. Results merge into bench/results.json (by name) and are
rendered to bench/results.md and bench/throughput.png.

  python3 scripts/bench.py --group gpt            # bare loop + both engines on the 1.4B GPT
  python3 scripts/bench.py --group te             # te_gpt d=4096: bf16 and each FP8 recipe
  python3 scripts/bench.py --group te_profile     # torch.profiler tables, bf16 vs FP8 (bare loop)
  python3 scripts/bench.py --group gpt_pair       # bare / launcher / bare / launcher, 40 steps each
  python3 scripts/bench.py --group te_deep        # te_gpt d=4096 with 16 layers (fills ~half the GPU)
  python3 scripts/bench.py --group hf_vs_gpt      # HF LlamaForCausalLM vs the built-in gpt, 1.4B dims, both engines
  python3 scripts/bench.py --group memory         # estimate vs measured peak: 1.4b/3b x ZeRO x AC x tp x FP8
  python3 scripts/bench.py --group memory8b       # the same axes at 8b
  python3 scripts/bench.py --group ac_peak        # gpt 1.4b seq 4096 mbs 8: AC none / full / selective
  python3 scripts/bench.py --group ac8b           # gpt 8b seq 8192: AC full / selective
  python3 scripts/bench.py --group te_tp          # te_gpt 8b FP8 delayed: tp=2 vs tp=1
  python3 scripts/bench.py --group cp32k          # gpt and te_gpt 3b at seq 32768: cp=2 vs cp=1
  python3 scripts/bench.py --group memory --dry   # the planned runs and their estimates; runs nothing
  python3 scripts/bench.py --report               # re-render md/png from results.json

The memory groups (MEMORY_GROUPS) also render bench/memory.md: each run's dry-run estimate
(computed here from the same overrides), its measured peak (allocated and reserved), and the
reference points of bench/memory_reference.json. A run that runs out of memory is recorded as OOM
with its estimate. Every run is bounded (`timeout`, default 600 s); on expiry the launcher and all
its descendants (torchrun, the ranks) are killed, so no rank keeps a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_report  # noqa: E402  (issue 16's now/after table and the peers' notes under results.md)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench"

GPT = dict(model="gpt", preset="1.4b", seq=2048, mbs=4, precision="bf16")
TE = dict(model="te_gpt", preset="2b", seq=4096, mbs=4, precision="bf16")


def entry(name, group, kind="launcher", engine="megatron_fsdp", fp8_params=False, **kw):
    return dict(name=name, group=group, kind=kind, engine=engine, fp8_params=fp8_params, **kw)


def hf_llama_config(preset: str) -> dict:
    """The LlamaConfig fields of a gpt preset's dims (one mapping: mfsdp_launch/hf/config.py)."""
    from types import SimpleNamespace

    sys.path.insert(0, str(ROOT))
    from mfsdp_launch.hf.config import llama_config
    from mfsdp_launch.models.llama_dims import resolve_gpt_dims

    dims = resolve_gpt_dims(SimpleNamespace(preset=preset, norm_eps=1e-5, rope_theta=10000.0))
    skip = ("architectures", "model_type", "torch_dtype", "dtype")
    return {k: v for k, v in llama_config(dims).items() if k not in skip}


def hydra_dict(d: dict) -> str:
    """A flat dict as a Hydra override value: {a: 1, b: false}."""
    return "{" + ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in d.items()) + "}"


MATRIX = [
    # The 1.4B plain-torch GPT (d=2048, 24 layers), seq 2048, bf16, ZeRO-3.
    entry("bare_gpt_1.4b_bf16_mbs4", "gpt", kind="bare", engine="bare megatron_fsdp", **GPT),
    entry("mfsdp_gpt_1.4b_bf16_mbs4", "gpt", **GPT),
    entry("fsdp2_gpt_1.4b_bf16_mbs4", "gpt", engine="fsdp2", **GPT),
    entry("mfsdp_gpt_1.4b_bf16_mbs8", "gpt", **dict(GPT, mbs=8)),
    entry("mfsdp_gpt_350m_bf16_mbs4", "gpt_more", **dict(GPT, preset="350m")),
    # TE GPT, d=4096, 8 layers (preset 2b), seq 4096: bf16 and each FP8 recipe, with and
    # without FP8 primary weights (fp8.params: FP8 all-gather, no per-step weight casts).
    entry("mfsdp_te_gpt_2b_bf16_mbs4", "te", **TE),
    entry("mfsdp_te_gpt_2b_delayed_mbs4", "te", **dict(TE, precision="delayed")),
    entry("mfsdp_te_gpt_2b_current_mbs4", "te", **dict(TE, precision="current")),
    entry("mfsdp_te_gpt_2b_blockwise_mbs4", "te", **dict(TE, precision="blockwise")),
    entry("mfsdp_te_gpt_2b_delayed_params_mbs4", "te", fp8_params=True, **dict(TE, precision="delayed")),
    entry("mfsdp_te_gpt_2b_current_params_mbs4", "te", fp8_params=True, **dict(TE, precision="current")),
    entry("mfsdp_te_gpt_1.4b_bf16_mbs4", "te_more", **dict(GPT, model="te_gpt")),
    entry("mfsdp_te_gpt_2b_bf16_mbs8", "te_more", **dict(TE, mbs=8)),
    entry("mfsdp_te_gpt_2b_delayed_params_mbs8", "te_more", fp8_params=True, **dict(TE, mbs=8, precision="delayed")),
    # The launcher-vs-bare ratio, interleaved (A B A B) so drift between runs hits both sides.
    *[entry(f"{kind}_gpt_1.4b_bf16_mbs4_pair{i}", "gpt_pair", kind=kind,
            engine="bare megatron_fsdp" if kind == "bare" else "megatron_fsdp", steps=40, log_interval=10, **GPT)
      for i in (1, 2) for kind in ("bare", "launcher")],
    # te_gpt d=4096 with 16 layers (3.5B params): bf16 and the two fastest FP8 recipes.
    entry("mfsdp_te_gpt_2b_l16_bf16_mbs4", "te_deep", n_layers=16, **TE),
    entry("mfsdp_te_gpt_2b_l16_delayed_mbs4", "te_deep", n_layers=16, **dict(TE, precision="delayed")),
    entry("mfsdp_te_gpt_2b_l16_current_mbs4", "te_deep", n_layers=16, **dict(TE, precision="current")),
    # The same 1.4B Llama dims as a Hugging Face LlamaForCausalLM (model=hf, SDPA) next to the
    # built-in gpt, both engines, in one call (A B A B per engine).
    *[entry(f"{engine_tag}_{model}_1.4b_bf16_mbs4_hfcmp", "hf_vs_gpt", engine=engine,
            **dict(GPT, model=model))
      for engine_tag, engine in (("mfsdp", "megatron_fsdp"), ("fsdp2", "fsdp2")) for model in ("gpt", "hf")],
    # Where the time goes (torch.profiler, bare loop on the same TE GPT).
    entry("profile_te_gpt_2b_bf16", "te_profile", kind="bare", engine="bare megatron_fsdp", profile=3, **TE),
    entry("profile_te_gpt_2b_delayed_params", "te_profile", kind="bare", engine="bare megatron_fsdp", profile=3,
          fp8_params=True, **dict(TE, precision="delayed")),
    entry("profile_te_gpt_2b_delayed", "te_profile", kind="bare", engine="bare megatron_fsdp", profile=3,
          **dict(TE, precision="delayed")),
]


# --- memory: estimate vs measured (2 GPUs, seq 4096, 6 steps, launcher.force_memory=true) ---------
MEMORY_GROUPS = ("memory", "memory8b", "ac_peak", "ac8b", "te_tp", "cp32k", "memory_reference")
MEM = dict(seq=4096, precision="bf16", steps=6, log_interval=2, force=True, timeout=300)


def mem_entry(name, group, model="gpt", preset="1.4b", mbs=1, engine="megatron_fsdp", **kw):
    return entry(name, group, engine=engine, **dict(MEM, model=model, preset=preset, mbs=mbs, **kw))


MATRIX += [
    # One axis at a time from gpt 1.4b mbs 2 (Megatron-FSDP, ZeRO-3, no AC, tp 1, bf16).
    mem_entry("mem_gpt_1.4b_z3", "memory", mbs=2),
    mem_entry("mem_gpt_1.4b_z2", "memory", mbs=2, zero=2),
    mem_entry("mem_gpt_1.4b_z1", "memory", mbs=2, zero=1),
    mem_entry("mem_gpt_1.4b_z3_acfull", "memory", mbs=2, ac="full"),
    mem_entry("mem_fsdp2_gpt_1.4b_z3", "memory", mbs=2, engine="fsdp2"),
    mem_entry("mem_fsdp2_gpt_1.4b_z3_tp2", "memory", mbs=2, engine="fsdp2", tp=2),
    mem_entry("mem_fsdp2_gpt_3b_z3_tp2", "memory", preset="3b", mbs=2, engine="fsdp2", tp=2),  # out of the fit
    mem_entry("mem_te_gpt_1.4b_z3_fp8", "memory", model="te_gpt", mbs=2, precision="delayed"),
    # 3b (tied 128k vocab: the fp32 loss buffers are a third of it).
    mem_entry("mem_gpt_3b_z3", "memory", preset="3b", mbs=2),
    mem_entry("mem_gpt_3b_z3_acfull", "memory", preset="3b", mbs=2, ac="full"),
    # 8b (a group of its own: each run starts in ~1 min): ZeRO-1 keeps the whole bf16 model and its
    # fp32 gradients on every rank (~118 GiB estimated).
    mem_entry("mem_gpt_8b_z3", "memory8b", preset="8b"),
    mem_entry("mem_gpt_8b_z3_acfull", "memory8b", preset="8b", ac="full"),
    mem_entry("mem_gpt_8b_z1", "memory8b", preset="8b", zero=1),
    mem_entry("mem_fsdp2_gpt_8b_z3_tp2", "memory8b", preset="8b", engine="fsdp2", tp=2),
    mem_entry("mem_te_gpt_8b_z3_fp8", "memory8b", model="te_gpt", preset="8b", precision="delayed"),
    # AC acceptance (issue 15): full <= 0.6x none at gpt 1.4b, seq 4096, mbs 8.
    *[mem_entry(f"acpeak_gpt_1.4b_mbs8_{ac}", "ac_peak", mbs=8, ac=ac, steps=8) for ac in ("none", "full", "selective")],
    # gpt 8b at seq 8192 (7,850 tokens/s/GPU was measured at seq 4096 without AC).
    *[mem_entry(f"ac8b_gpt_8b_s8192_{ac}", "ac8b", preset="8b", seq=8192, ac=ac, steps=8) for ac in ("full", "selective")],
    # te_gpt 8b FP8 delayed at the measured 126 GiB point: tp=2 (TE tp_group + sequence parallel) vs tp=1.
    *[mem_entry(f"tetp_te_gpt_8b_delayed_s8192_tp{tp}", "te_tp", model="te_gpt", preset="8b", seq=8192,
                precision="delayed", tp=tp, steps=8) for tp in (1, 2)],
    # seq 32768 on 2 GPUs, 3b without AC: cp=1 is estimated far over an H200 (gpt ~175, te_gpt ~155 GiB:
    # 28 blocks at 32k tokens plus 47 GiB of fp32 loss buffers for the 128k vocab), cp=2 halves the
    # tokens per rank and fits (~103 / ~92 GiB). 8b with AC full would sit at ~134 GiB for cp=1: too
    # close to the H200's 139.8 GiB to say OOM.
    *[mem_entry(f"cp32k_{model}_3b_cp{cp}", "cp32k", model=model, preset="3b", seq=32768, cp=cp, steps=5,
                log_interval=1) for model in ("gpt", "te_gpt") for cp in (2, 1)],
]


# --- te_gpt 8b FP8 at seq 8192 (issue 16 goal 1: >= 15,000 tokens/s/GPU on 2 H200s) --------------
# The measured point is 13,733 (FP8 delayed, grad_accum 8, 126 GiB of 140). The first run repeats it
# and profiles its last step (top kernels into bench/top_ops_<name>.txt); the others change one
# thing each: expandable allocator segments (at 126 GiB the caching allocator may be freeing and
# re-mapping blocks: the rows' alloc_retries say), current scaling (Megatron-Bridge's FP8-CS), FP8
# primary weights (slower at d=4096 on NVLink; re-checked where memory is tight).
TE8B = dict(model="te_gpt", preset="8b", seq=8192, mbs=1, ga=8, precision="delayed", steps=6, log_interval=1,
            timeout=300)
EXPSEG = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
MATRIX += [
    entry("te8b_delayed_ga8", "te8b", extra=["train.profile={start: 6, steps: 1}"], **TE8B),
    entry("te8b_delayed_ga8_expseg", "te8b", env=EXPSEG, **TE8B),
    entry("te8b_current_ga8_expseg", "te8b", env=EXPSEG, **dict(TE8B, precision="current")),
    entry("te8b_delayed_params_ga8_expseg", "te8b", env=EXPSEG, fp8_params=True, **TE8B),
]
# Second round (te8b_opt), after the profile: the reference again, then one change each and all
# together. bf16 gradients halve the reduce-scatter bytes (and 8 GiB of gradient buffer; what
# Megatron-FSDP's guide recommends, --grad-reduce-in-bf16); TE's fused cross-entropy drops the fp32
# copy of the 8192 x 128256 logits and its softmax kernels; FP8 attention (fp8.attention) runs the
# cuDNN attention, ~1/4 of the step at seq 8192, on FP8 inputs. (NCCL user buffers, engine.nccl_ub,
# are not measured: Megatron's allocator turns on NVLink multicast, which this GPU machine keeps off.)
BF16_GRADS, FUSED_CE, FP8_ATTN = "precision.main_grads_dtype=bf16", "model.loss_kernel=te_fused", "fp8.attention=true"
ALL3 = [BF16_GRADS, FUSED_CE, FP8_ATTN]
MATRIX += [
    entry("te8b_opt_ref", "te8b_opt", **TE8B),
    entry("te8b_opt_bf16grads", "te8b_opt", extra=[BF16_GRADS], **TE8B),
    entry("te8b_opt_fusedce", "te8b_opt", extra=[FUSED_CE], **TE8B),
    entry("te8b_opt_fp8attn", "te8b_opt", extra=[FP8_ATTN], **TE8B),
    entry("te8b_opt_all3", "te8b_opt", extra=ALL3, **TE8B),
    # With the ~15 GiB the first two free, ZeRO-2 fits: the weights stay whole, so no all-gather per
    # micro-batch (the bf16 all-gather was 11.7 % of kernel time), one per step after the update.
    entry("te8b_opt_all3_z2", "te8b_opt", zero=2, extra=ALL3, **TE8B),
    entry("te8b_opt_all3_ga16", "te8b_opt", extra=ALL3, **dict(TE8B, ga=16, steps=5)),
]
# The same changes on one GPU (no communication): the 8b's layer at seq 8192, 8 of its 32 layers, so
# the attention / GEMM / loss mix per token is the 8b's while the model fits one H200.
TE8B_L8 = dict(TE8B, n_layers=8)
MATRIX += [
    entry("te8bl8_ref", "te8b_l8", **TE8B_L8),
    entry("te8bl8_fusedce", "te8b_l8", extra=[FUSED_CE], **TE8B_L8),
    entry("te8bl8_fp8attn", "te8b_l8", extra=[FP8_ATTN], **TE8B_L8),
    entry("te8bl8_all3", "te8b_l8", extra=ALL3, **TE8B_L8),
    # where the rest of the time goes with all three (last step profiled: bench/top_ops_<name>.txt)
    entry("te8bl8_all3_profile", "te8b_l8_profile", extra=[*ALL3, "train.profile={start: 6, steps: 1}"], **TE8B_L8),
]
# gpt 1.4b towards 50 % MFU (issue 16 goal 2), seq 2048: the plain-torch gpt compiled per block
# with the fused loss, and the same architecture on TE layers (fused RMSNorm, SwiGLU, RoPE, attention),
# at micro-batch 8 (50 GiB; mbs 4 is the peers' setting, in scripts/bench_peers.py).
MATRIX += [
    entry("gpt14_mfsdp_gpt_mbs8_compile_fusedce", "gpt14_opt", extra=["train.compile=true", FUSED_CE],
          **dict(GPT, mbs=8)),
    # its kernels (one GPU: the compute alone, without FSDP's communication)
    entry("gpt14_mfsdp_gpt_mbs8_compile_fusedce_profile", "gpt14_profile",
          extra=["train.compile=true", FUSED_CE, "train.profile={start: 10, steps: 1}"], steps=12, **dict(GPT, mbs=8)),
    entry("gpt14_mfsdp_te_gpt_mbs8", "gpt14_opt", **dict(GPT, model="te_gpt", mbs=8)),
    entry("gpt14_mfsdp_te_gpt_mbs8_fusedce", "gpt14_opt", extra=[FUSED_CE],
          **dict(GPT, model="te_gpt", mbs=8)),
    # TE's multi-tensor FusedAdam, and 4 micro-batches per step to spread the optimizer and the clip
    entry("gpt14_mfsdp_te_gpt_mbs8_fusedce_fusedadam_ga4", "gpt14_opt", extra=[FUSED_CE, "optim.impl=te_fused"],
          **dict(GPT, model="te_gpt", mbs=8, ga=4)),
]
# The issue's other "now" rows, re-measured: te_gpt 8b on the hfsdp_fp8 recipe's mesh on one node
# (dp_outer=2, outer ZeRO-1, seq 4096; FP8 delayed and bf16) and gpt 8b bf16 at seq 4096.
HFSDP8B = dict(model="te_gpt", preset="8b", seq=4096, mbs=1, steps=8, log_interval=2, timeout=300,
               outer=(2, "optim"))
MATRIX += [
    entry("now_te_gpt_8b_hfsdp_delayed_s4096", "now8b", **dict(HFSDP8B, precision="delayed")),
    entry("now_te_gpt_8b_hfsdp_bf16_s4096", "now8b", **dict(HFSDP8B, precision="bf16")),
    entry("now_gpt_8b_bf16_s4096", "now8b", model="gpt", preset="8b", seq=4096, mbs=1, precision="bf16", steps=8,
          log_interval=2, timeout=300),
]


def memory_reference() -> list:
    """The measured reference points (bench/memory_reference.json), as bench entries."""
    data = json.loads((OUT / "memory_reference.json").read_text())
    return [dict(entry(p["name"], "memory_reference", engine=p.get("engine", "megatron_fsdp"),
                       fp8_params=p.get("fp8_params", False)),
                 **{k: v for k, v in p.items() if k not in ("engine", "fp8_params")}) for p in data["points"]]


def gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _env(extra: dict = None):
    env = dict(os.environ, **(extra or {}))
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def launcher_args(e: dict, world: int, steps: int, log_interval: int, run_dir: Path) -> list:
    if e["model"] == "hf":  # the preset's dims as an HF config
        model_args = ["model=hf", "model.hf_class=LlamaForCausalLM",
                      f"model.hf_config={hydra_dict(hf_llama_config(e['preset']))}"]
    else:
        model_args = [f"model={e['model']}", f"model.preset={e['preset']}"]
    dp_outer, outer = e.get("outer", (1, "no_shard"))  # HSDP/HFSDP: (dp_outer, outer strategy)
    args = [
        f"engine={e['engine']}", *model_args, "model.init_on_meta=true",
        "data=synthetic", f"train.steps={steps}", f"train.log_interval={log_interval}",
        f"train.seq_len={e['seq']}", f"train.micro_batch_size={e['mbs']}", "train.progress=false",
        "precision.compute_dtype=bf16", "precision.main_params_dtype=fp32", "precision.main_grads_dtype=fp32",
        f"sharding.zero_dp_strategy={e.get('zero', 3)}", f"sharding.outer_dp_sharding_strategy={outer}",
        f"mesh.dp_outer={dp_outer}", "mesh.dp_shard=-1", f"mesh.tp={e.get('tp', 1)}", f"mesh.cp={e.get('cp', 1)}",
        f"launcher.nproc_per_node={world}",
        "checkpoint.save_final=false", "checkpoint.resume=never", f"run.dir={run_dir}",
    ]
    if e["model"] == "te_gpt":
        args.append("model.params_dtype=bf16")
    if e.get("n_layers"):
        args.append(f"model.n_layers={e['n_layers']}")
    if e.get("ac", "none") != "none":
        args.append(f"model.activation_checkpointing={e['ac']}")
    if e.get("ga", 1) != 1:
        args.append(f"train.grad_accum_steps={e['ga']}")
    args += e.get("extra", [])  # further overrides of one entry (e.g. train.profile)
    if e.get("ac_every"):
        args.append(f"model.ac_every={e['ac_every']}")
    if e.get("force"):  # measure what happens past the pre-spawn memory check
        args.append("launcher.force_memory=true")
    if e["precision"] != "bf16":
        args += [f"fp8.recipe={e['precision']}", f"fp8.params={str(e['fp8_params']).lower()}",
                 f"engine.keep_fp8_transpose_cache={str(e['fp8_params']).lower()}"]
    return args


def run_bounded(cmd: list, timeout: float, env: dict = None) -> subprocess.CompletedProcess:
    """Run `cmd` for at most `timeout` s. On expiry the process and every descendant (torchrun and
    the ranks, which sit in sessions of their own) get SIGKILL, so no rank keeps a GPU; the result
    then has returncode -9 and "timed out" on stderr."""
    sys.path.insert(0, str(ROOT))
    from mfsdp_launch.supervise import kill_tree

    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
        err += f"\nbench: timed out after {timeout:.0f} s; killed the launcher and its descendants\n"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _peak_reserved(rows: list):
    got = [r["peak_reserved_gib"] for r in rows if r.get("peak_reserved_gib") is not None]
    return max(got) if got else None  # (None on a CPU)


def run_launcher(e: dict, world: int, steps: int, log_interval: int, log) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-{e['name']}-"))
    cmd = [sys.executable, "-m", "mfsdp_launch", *launcher_args(e, world, steps, log_interval, run_dir)]
    t0 = time.time()
    proc = run_bounded(cmd, e.get("timeout", 600), e.get("env"))
    top_ops = run_dir / "profile" / "top_ops.txt"  # (train.profile: rank 0's table of the top kernels)
    if top_ops.exists():
        (OUT / f"top_ops_{e['name']}.txt").write_text(top_ops.read_text())
    env = " ".join(f"{k}={v}" for k, v in e.get("env", {}).items())
    log.write(f"\n=== {e['name']} ({time.time() - t0:.0f} s, exit {proc.returncode})\n$ {env} {' '.join(cmd)}\n"
              f"{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}\n")
    log.flush()
    rows = []
    if (run_dir / "metrics.jsonl").exists():
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    if proc.returncode != 0 or not rows:
        from mfsdp_launch.oom import LINE_RE

        oom = next((x for x in proc.stderr.splitlines() if LINE_RE.match(x)), None)
        return dict(e, ok=False, oom=oom is not None, error=(oom or proc.stderr or proc.stdout)[-800:], world=world,
                    peak_mem_gib=max((r["peak_mem_gib"] for r in rows), default=None),
                    peak_reserved_gib=_peak_reserved(rows))
    use = rows[1:] or rows
    return dict(e, ok=True, world=world,
                peak_reserved_gib=_peak_reserved(rows),
                tokens_per_s_per_gpu=statistics.median(r["tokens_per_s_per_gpu"] for r in use),
                mfu=statistics.median(r["mfu"] for r in use) if use[0]["mfu"] is not None else None,
                peak_mem_gib=max(r["peak_mem_gib"] for r in rows),
                step_time_s=statistics.median(r["step_time_s"] for r in use),
                loss=rows[-1]["loss"], rows=len(rows), wall_s=round(time.time() - t0, 1),
                alloc_retries=rows[-1].get("alloc_retries"))


def run_bare(e: dict, world: int, steps: int, log) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           str(ROOT / "scripts" / "bare_loop.py"), "--model", e["model"], "--preset", e["preset"],
           "--seq", str(e["seq"]), "--mbs", str(e["mbs"]), "--steps", str(steps),
           "--fp8", e["precision"] if e["precision"] != "bf16" else "none"]
    if e.get("fp8_params"):
        cmd.append("--fp8-params")
    if e.get("profile"):
        cmd += ["--profile", str(e["profile"])]
    if e.get("n_layers"):
        cmd += ["--n-layers", str(e["n_layers"])]
    t0 = time.time()
    proc = run_bounded(cmd, e.get("timeout", 600))
    log.write(f"\n=== {e['name']} ({time.time() - t0:.0f} s, exit {proc.returncode})\n$ {' '.join(cmd)}\n"
              f"{proc.stdout[-20000:]}\n{proc.stderr[-4000:]}\n")
    log.flush()
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH_JSON "):
            got = json.loads(line[len("BENCH_JSON "):])
            got.pop("name", None)
            return dict(e, **got, ok=True, wall_s=round(time.time() - t0, 1))
    return dict(e, ok=False, error=(proc.stderr or proc.stdout)[-800:], world=world)


def estimate_entry(e: dict, world: int) -> dict:
    """The dry run's per-rank estimate for an entry, from the overrides its run uses (no torch):
    {"estimate_gib", "parts"} or {"refused": the one-line ConfigError}."""
    sys.path.insert(0, str(ROOT))
    from mfsdp_launch.config.compose import compose
    from mfsdp_launch.errors import ConfigError
    from mfsdp_launch.launch import check
    from mfsdp_launch.memory import GIB, estimate
    from mfsdp_launch.mesh import ParallelDims, world_size

    args = launcher_args(e, world, e.get("steps", 6), e.get("log_interval", 2), Path(tempfile.gettempdir()) / "bench-dry")
    out = {}
    try:
        cfg = compose([*args, "launcher.dry_run=true"])
        check(cfg)
    except ConfigError as exc:
        out["refused"] = str(exc)  # (still estimated below: what it would need once allowed)
    try:
        est = estimate(cfg, ParallelDims.from_config(cfg.mesh, world_size(cfg.launcher)))
    except Exception:  # noqa: BLE001 - a config too broken to estimate
        return out
    return dict(out, estimate_gib=est.total / GIB, parts={k: round(v / GIB, 2) for k, v in est.as_dict().items()})


def _axes(e: dict) -> str:
    fp8 = e["precision"] if e["precision"] != "bf16" else "-"
    return (f"{e['engine']} {_model(e)} z{e.get('zero', 3)} ac={e.get('ac', 'none')}"
            f"{e.get('ac_every', '') and '/' + str(e['ac_every'])} tp{e.get('tp', 1)} cp{e.get('cp', 1)} fp8={fp8}"
            f"{'+params' if e.get('fp8_params') else ''} seq{e['seq']}x{e['mbs']}")


def plan(todo: list, world: int) -> int:
    """--dry: each planned run with its estimate (or the one line that refuses it); runs nothing."""
    for e in todo:
        est = estimate_entry(e, world)
        what = f"~{est['estimate_gib']:6.1f} GiB" if "estimate_gib" in est else ""
        what += f"  refused today: {est['refused']}" if est.get("refused") else ""
        ref = f"  (measured {e['measured_gib']} GiB)" if e.get("measured_gib") else ""
        print(f"{e['name']:44s} {_axes(e):70s} {what}{ref}", flush=True)
    return 0


def load_results() -> dict:
    path = OUT / "results.json"
    if path.exists():
        return json.loads(path.read_text())
    return {"runs": {}}


def save_results(res: dict) -> None:
    OUT.mkdir(exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(res, indent=1, sort_keys=True))


def _fmt(x, spec):
    return format(x, spec) if isinstance(x, (int, float)) else "—"


def _model(r: dict) -> str:
    return f"{r['model']} {r['preset']}" + (f" ({r['n_layers']} layers)" if r.get("n_layers") else "")


def render(res: dict) -> None:
    OUT.mkdir(exist_ok=True)
    runs = [r for r in res["runs"].values()]
    order = {e["name"]: i for i, e in enumerate(MATRIX)}
    runs.sort(key=lambda r: (order.get(r["name"], order.get(r["name"].rsplit("_steps", 1)[0], 999) + 0.5), r["name"]))
    lines = [f"# Throughput ({res.get('device', '?')})", "",
             "tokens/s/GPU and MFU are medians over logged intervals after warm-up; MFU is against the "
             "dense bf16 peak (989 TFLOP/s for H200) also for FP8 runs. ZeRO-3, bf16 compute, fp32 main "
             "weights and gradients, synthetic data. `bare` = scripts/bare_loop.py (no launcher).", "",
             "| run | engine | model | seq | mbs | precision | FP8 params | GPUs | tokens/s/GPU | MFU | peak mem GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        if r.get("profile") or r.get("group") in MEMORY_GROUPS:  # those are in memory.md
            continue
        if not r.get("ok"):
            lines.append(f"| {r['name']} | {r['engine']} | {_model(r)} | {r['seq']} | {r['mbs']} | "
                         f"{r['precision']} | {r.get('fp8_params')} | {r.get('world', '?')} | failed | | |")
            continue
        lines.append(f"| {r['name']} | {r['engine']} | {_model(r)} | {r['seq']} | {r['mbs']} | "
                     f"{r['precision']} | {'yes' if r.get('fp8_params') else 'no'} | {r['world']} | "
                     f"{_fmt(r['tokens_per_s_per_gpu'], ',.0f')} | "
                     f"{_fmt(100 * r['mfu'] if r.get('mfu') is not None else None, '.1f')}% | "
                     f"{_fmt(r['peak_mem_gib'], '.1f')} |")
    by = {r["name"]: r for r in runs if r.get("ok")}
    notes = []
    bare, mf = by.get("bare_gpt_1.4b_bf16_mbs4"), by.get("mfsdp_gpt_1.4b_bf16_mbs4")
    if bare and mf:
        ratio = mf["tokens_per_s_per_gpu"] / bare["tokens_per_s_per_gpu"]
        notes.append(f"- launcher (megatron_fsdp) / bare loop, 1.4B bf16 mbs 4: **{ratio:.3f}x** (target >= 0.98)")
    b40, m40 = by.get("bare_gpt_1.4b_bf16_mbs4_steps40"), by.get("mfsdp_gpt_1.4b_bf16_mbs4_steps40")
    if b40 and m40:
        notes.append(f"- the same pair re-measured in a later call (40 steps, median of 10-step intervals): "
                     f"**{m40['tokens_per_s_per_gpu'] / b40['tokens_per_s_per_gpu']:.3f}x**")
    pairs = [(by.get(f"bare_gpt_1.4b_bf16_mbs4_pair{i}"), by.get(f"launcher_gpt_1.4b_bf16_mbs4_pair{i}"))
             for i in (1, 2)]
    if all(b and m for b, m in pairs):
        each = ", ".join(f"{m['tokens_per_s_per_gpu'] / b['tokens_per_s_per_gpu']:.3f}x" for b, m in pairs)
        total = sum(m["tokens_per_s_per_gpu"] for _, m in pairs) / sum(b["tokens_per_s_per_gpu"] for b, _ in pairs)
        notes.append(f"- interleaved bare/launcher/bare/launcher (one call, 40 steps each): pairs {each}; "
                     f"mean launcher / mean bare **{total:.3f}x** (target >= 0.98)")
    f2 = by.get("fsdp2_gpt_1.4b_bf16_mbs4")
    if bare and f2:
        notes.append(f"- launcher (fsdp2) / bare Megatron-FSDP loop: {f2['tokens_per_s_per_gpu'] / bare['tokens_per_s_per_gpu']:.3f}x")
    bf = by.get("mfsdp_te_gpt_2b_bf16_mbs4")
    fp8 = [r for r in runs if r.get("ok") and r["model"] == "te_gpt" and r["preset"] == "2b" and r["mbs"] == 4
           and r["precision"] != "bf16" and r["kind"] == "launcher"]
    if bf and fp8:
        best = max(fp8, key=lambda r: r["tokens_per_s_per_gpu"])
        notes.append(f"- te_gpt d=4096 seq 4096: bf16 MFU {100 * bf['mfu']:.1f}% (target >= 50%); best FP8 "
                     f"({best['name']}) / bf16 = **{best['tokens_per_s_per_gpu'] / bf['tokens_per_s_per_gpu']:.3f}x** "
                     "(target >= 1.25)")
    bf16, deep = by.get("mfsdp_te_gpt_2b_l16_bf16_mbs4"), [
        by.get(f"mfsdp_te_gpt_2b_l16_{r}_mbs4") for r in ("delayed", "current")]
    if bf16 and any(deep):
        best = max((r for r in deep if r), key=lambda r: r["tokens_per_s_per_gpu"])
        notes.append(f"- te_gpt d=4096, 16 layers: bf16 MFU {100 * bf16['mfu']:.1f}%, {bf16['peak_mem_gib']:.0f} GiB; "
                     f"best FP8 ({best['name']}) / bf16 = **{best['tokens_per_s_per_gpu'] / bf16['tokens_per_s_per_gpu']:.3f}x**")
    for tag, engine in (("mfsdp", "megatron_fsdp"), ("fsdp2", "fsdp2")):
        g, h = by.get(f"{tag}_gpt_1.4b_bf16_mbs4_hfcmp"), by.get(f"{tag}_hf_1.4b_bf16_mbs4_hfcmp")
        if g and h:
            notes.append(f"- {engine}, 1.4B Llama dims: built-in gpt {g['tokens_per_s_per_gpu']:,.0f} vs HF "
                         f"LlamaForCausalLM {h['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU: gpt is "
                         f"**{g['tokens_per_s_per_gpu'] / h['tokens_per_s_per_gpu']:.3f}x**")
    if notes:
        lines += ["", *notes]
    lines += bench_report.report_lines(res["runs"])  # the peers' and small models' notes, issue 16's table
    (OUT / "results.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    ok = [r for r in runs if r.get("ok") and not r.get("profile")]
    if not ok:
        return
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.45 * len(ok) + 2))
    names = [r["name"] for r in ok]
    axes[0].barh(names, [r["tokens_per_s_per_gpu"] for r in ok], color="tab:blue")
    axes[0].set_xlabel("tokens/s/GPU")
    axes[1].barh(names, [100 * (r.get("mfu") or 0) for r in ok], color="tab:green")
    axes[1].set_xlabel("MFU % (bf16 peak)")
    axes[1].set_yticklabels([])
    for ax in axes:
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"mfsdp-launch throughput, {res.get('device', '')}")
    fig.tight_layout()
    fig.savefig(OUT / "throughput.png", dpi=110)


def _mem_cell(r: dict) -> str:
    if r.get("refused"):
        return "refused"
    if r.get("oom"):
        return "OOM"
    if not r.get("ok"):
        return "failed"
    return _fmt(r.get("peak_reserved_gib"), ".1f")


def current_estimate(r: dict):
    """Today's estimate (GiB) for a recorded run's overrides: the table judges the model as it is now,
    not the one the run was planned with."""
    return estimate_entry(r, r.get("world", 2)).get("estimate_gib")


def reserved_points(res: dict) -> list:
    """The memory groups' runs that measured a reserved peak."""
    return [r for r in res["runs"].values() if r.get("group") in MEMORY_GROUPS and r.get("ok")
            and r.get("peak_reserved_gib")]


def render_memory(res: dict) -> None:
    """bench/memory.md: estimate vs measured for the memory groups' runs, then the reference points."""
    order = {e["name"]: i for i, e in enumerate(MATRIX)}
    runs = sorted((r for r in res["runs"].values() if r.get("group") in MEMORY_GROUPS),
                  key=lambda r: order.get(r["name"], 999))
    lines = [f"# Memory: the dry-run estimate against the measured peak ({res.get('device', '?')})", "",
             "Written by `scripts/bench.py --group memory` (and ac_peak, ac8b, te_tp, cp32k). The estimate is "
             "today's `mfsdp_launch/memory.py` for the run's overrides; it aims at the **reserved** peak "
             "(torch.cuda.max_memory_reserved, what runs out); `allocated` is max_memory_allocated. "
             "Target: within 15 % of reserved. OOM: the run ran out of memory (the estimate says by how much "
             "it should have). bf16 compute, fp32 main weights and gradients, synthetic data, "
             "launcher.force_memory=true. How the estimate works: docs/memory.md.", "",
             "| run | engine, model, ZeRO, AC, tp, cp, FP8, seq x mbs | estimate GiB | reserved GiB | allocated GiB "
             "| estimate / reserved | within 15 % | tokens/s/GPU |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        est, got = current_estimate(r), r.get("peak_reserved_gib") if r.get("ok") else None
        ratio = est / got if (est and got) else None
        within = ("yes" if abs(ratio - 1) <= 0.15 else "**no**") if ratio else ""
        lines.append(f"| {r['name']} | {_axes(r)} | {_fmt(est, '.1f')} | {_mem_cell(r)} | "
                     f"{_fmt(r.get('peak_mem_gib') if r.get('ok') else None, '.1f')} | {_fmt(ratio, '.2f')} | {within} | "
                     f"{_fmt(r.get('tokens_per_s_per_gpu'), ',.0f')} |")
    lines += ["", "## Reference points measured before (max_memory_allocated)", "",
              "| point | engine, model, ZeRO, AC, tp, cp, FP8, seq x mbs | estimate GiB | measured GiB | ratio | source |",
              "|---|---|---|---|---|---|"]
    for e in memory_reference():
        est = estimate_entry(e, 2).get("estimate_gib")
        lines.append(f"| {e['name']} | {_axes(e)} | {_fmt(est, '.1f')} | {e['measured_gib']:.1f} | "
                     f"{_fmt(est / e['measured_gib'] if est else None, '.2f')} | {e['source']} |")
    by = {r["name"]: r for r in runs if r.get("ok")}
    none, full = by.get("acpeak_gpt_1.4b_mbs8_none"), by.get("acpeak_gpt_1.4b_mbs8_full")
    notes = []
    if none and full:
        q = full["peak_reserved_gib"] / none["peak_reserved_gib"]
        notes.append(f"- AC full / none, gpt 1.4b seq 4096 mbs 8: reserved peak **{q:.2f}x** (target <= 0.6)")
    for model in ("gpt", "te_gpt"):
        one, two = res["runs"].get(f"cp32k_{model}_3b_cp1"), by.get(f"cp32k_{model}_3b_cp2")
        if one and two:
            notes.append(f"- {model} 3b seq 32768: cp=2 trains at {two['peak_reserved_gib']:.1f} GiB, "
                         f"{two['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU; cp=1: {_mem_cell(one)}")
    if notes:
        lines += ["", *notes]
    (OUT / "memory.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--group", action="append", default=[],
                    help="gpt | gpt_pair | te | te_deep | te_more | te_profile | hf_vs_gpt | te8b | " + " | ".join(MEMORY_GROUPS))
    ap.add_argument("--only", action="append", default=[], help="entry names")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--log-interval", type=int, default=5)
    ap.add_argument("--report", action="store_true", help="only re-render results.md / throughput.png")
    ap.add_argument("--log", default=str(OUT / "bench.log"))
    ap.add_argument("--dry", action="store_true", help="print the planned runs and their memory estimates; run nothing")
    ap.add_argument("--world", type=int, default=2, help="GPUs assumed by --dry (default 2)")
    a = ap.parse_args()
    if a.dry:
        pool = MATRIX + (memory_reference() if "memory_reference" in a.group else [])
        return plan([e for e in pool if e["group"] in a.group or e["name"] in a.only], a.world)
    res = load_results()
    if not a.report:
        import torch

        world = gpus()
        if world == 0:
            print("no GPU: nothing to benchmark", file=sys.stderr)
            return 1
        res["device"] = f"{world}x {torch.cuda.get_device_name(0)}"
        todo = [e for e in MATRIX if e["group"] in a.group or e["name"] in a.only]
        OUT.mkdir(exist_ok=True)
        with open(a.log, "a") as log:
            for e in todo:
                t0 = time.time()
                steps = e.get("steps", a.steps)
                est = estimate_entry(e, world) if e["group"] in MEMORY_GROUPS else {}
                if est.get("refused"):  # refused before spawning: record it, spend no GPU time
                    r = dict(e, ok=False, world=world, error=est["refused"], **est)
                elif e["kind"] == "bare":
                    r = run_bare(e, world, steps if not e.get("profile") else 8, log)
                else:
                    r = run_launcher(e, world, steps, e.get("log_interval", a.log_interval), log)
                r.update(est)
                r["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
                res["runs"][e["name"]] = r
                save_results(res)
                parts = [e["name"] + ":", "ok" if r.get("ok") else "FAILED"]
                if r.get("tokens_per_s_per_gpu"):
                    parts.append(f"{r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU")
                if r.get("mfu"):
                    parts.append(f"MFU {100 * r['mfu']:.1f}%")
                if r.get("peak_mem_gib"):
                    parts.append(f"{r['peak_mem_gib']:.1f} GiB")
                if r.get("alloc_retries"):
                    parts.append(f"{r['alloc_retries']} allocator retries")
                parts.append(f"({time.time() - t0:.0f} s)")
                print(" ".join(parts), flush=True)
                if not r.get("ok"):
                    print("   " + r.get("error", "")[-600:].replace("\n", "\n   "), flush=True)
    render(res)
    render_memory(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
