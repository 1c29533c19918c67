"""Throughput benchmark: engine x model size x micro-batch x precision, on the GPUs present.

The matrix is data: bench/matrix.yaml holds the groups and their named entries (scripts/bench_matrix.py
loads it). Each launcher entry is a real `python -m mfsdp_launch ...` run (synthetic data, no
checkpoint save); tokens/s/GPU and MFU are the medians of its metrics.jsonl rows after the first
(warm-up) row, peak memory the max. "bare" entries run scripts/bare_loop.py (no launcher; the
same gradient clipping as train.grad_clip's default) under torchrun in the same call, as the
reference. Results merge into bench/results.json (by name) and
are rendered to bench/results.md and bench/throughput.png.

  python3 scripts/bench.py --list                 # the groups, what each measures, their entries
  python3 scripts/bench.py --group gpt            # bare loop + both engines on the 1.4B GPT
  python3 scripts/bench.py --group te --group te_profile
  python3 scripts/bench.py --only te8b_opt_ref --only te8b_opt_all3
  python3 scripts/bench.py --group te8b_l8_more --tag _h100_s30   # rows te8bl8m_all3_h100_s30, ...
  python3 scripts/bench.py --group memory --dry   # the planned runs and their estimates; runs nothing
  python3 scripts/bench.py --report               # re-render md/png from results.json

The memory groups (`memory: true` in the matrix) also render bench/memory.md: each run's dry-run
estimate (computed here from the same overrides), its measured peak (allocated and reserved), and
the reference points of bench/memory_reference.json. A run that runs out of memory is recorded as
OOM with its estimate. Every run is bounded (`timeout`, default 600 s); on expiry the launcher and
all its descendants (torchrun, the ranks) are killed, so no rank keeps a GPU. The run output goes to
bench/bench.log and a profiled launcher run's kernel table to bench/top_ops_<name>.txt (both
git-ignored: summarize a device session in bench/reports/ instead).
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
from bench_matrix import ABOUT, GROUPS, MATRIX, MEMORY_GROUPS, entry  # noqa: E402,F401  (bench/matrix.yaml)

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench"


# model=hf shapes that no gpt preset has: Llama-3.2-1B (tied embeddings, 128k vocabulary).
HF_SHAPES = {"llama3.2_1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                                 num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                                 rope_theta=500000.0, max_position_embeddings=131072)}


def hf_llama_config(preset: str) -> dict:
    """The LlamaConfig fields of a gpt preset's dims (one mapping: mfsdp_launch/models/llama/hf_config.py),
    or of an HF_SHAPES entry."""
    if preset in HF_SHAPES:
        return dict(HF_SHAPES[preset])
    from types import SimpleNamespace

    sys.path.insert(0, str(ROOT))
    from mfsdp_launch.models.llama.hf_config import llama_config
    from mfsdp_launch.models.llama.dims import resolve_gpt_dims

    dims = resolve_gpt_dims(SimpleNamespace(preset=preset, norm_eps=1e-5, rope_theta=10000.0))
    skip = ("architectures", "model_type", "torch_dtype", "dtype")
    return {k: v for k, v in llama_config(dims).items() if k not in skip}


def hydra_dict(d: dict) -> str:
    """A flat dict as a Hydra override value: {a: 1, b: false}."""
    return "{" + ", ".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}" for k, v in d.items()) + "}"


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
    if e.get("recipe"):  # the recipe as shipped: only the run's length, its place and no final save
        return [f"+recipe={e['recipe']}", f"launcher.nproc_per_node={world}", f"train.steps={steps}",
                f"train.log_interval={log_interval}", "train.progress=false", "checkpoint.save_final=false",
                "checkpoint.resume=never", f"run.dir={run_dir}", *e.get("extra", [])]
    if e["model"] == "hf":  # the preset's dims as an HF config (n_layers: its num_hidden_layers)
        fields = dict(hf_llama_config(e["preset"]), **({"num_hidden_layers": e["n_layers"]} if e.get("n_layers") else {}))
        model_args = ["model=hf", "model.hf_class=LlamaForCausalLM", f"model.hf_config={hydra_dict(fields)}"]
    else:
        model_args = [f"model={e['model']}", f"model.preset={e['preset']}"]
    dp_outer, outer = e.get("outer", (1, "no_shard"))  # HSDP/HFSDP: (dp_outer, outer strategy)
    args = [
        # meta-device init unless the entry says (Megatron-FSDP's no_shard refuses it)
        f"engine={e['engine']}", *model_args, f"model.init_on_meta={str(e.get('init_on_meta', True)).lower()}",
        *data_args(e), f"train.steps={steps}", f"train.log_interval={log_interval}",
        f"train.seq_len={e['seq']}", f"train.micro_batch_size={e['mbs']}", "train.progress=false",
        "precision.compute_dtype=bf16", "precision.main_params_dtype=fp32",
        f"precision.main_grads_dtype={e.get('grads', 'fp32')}",
        f"sharding.zero_dp_strategy={e.get('zero', 3)}", f"sharding.outer_dp_sharding_strategy={outer}",
        f"mesh.dp_outer={dp_outer}", "mesh.dp_shard=-1", f"mesh.tp={e.get('tp', 1)}", f"mesh.cp={e.get('cp', 1)}",
        f"launcher.nproc_per_node={world}",
        "checkpoint.save_final=false", "checkpoint.resume=never", f"run.dir={run_dir}",
    ]
    if e["model"] == "te_gpt":
        args.append("model.params_dtype=bf16")
    if e.get("n_layers") and e["model"] != "hf":
        args.append(f"model.n_layers={e['n_layers']}")
    if e.get("peft"):  # LoRA over a pretrained (here: random) bf16 base of the same dims
        args += [f"model.init_from={lora_base(e)}", f"model.peft={e['peft']}"]
    if e.get("ac", "none") != "none":
        args.append(f"model.activation_checkpointing={e['ac']}")
    if e.get("ga", 1) != 1:
        args.append(f"train.grad_accum_steps={e['ga']}")
    args += e.get("extra", [])  # further overrides of one entry (e.g. train.profile)
    if e.get("ac_every"):
        args.append(f"model.ac_every={e['ac_every']}")
    if e.get("force"):  # measure what happens past the pre-spawn memory check
        args.append("launcher.force_memory=true")
    if e["precision"].startswith("torchao_") or e["precision"] == "fused_rowwise":  # FP8 linears, no TE: the recipe alone
        args.append(f"fp8.recipe={e['precision']}")
    elif e["precision"] != "bf16":
        args += [f"fp8.recipe={e['precision']}", f"fp8.params={str(e['fp8_params']).lower()}",
                 f"engine.keep_fp8_transpose_cache={str(e['fp8_params']).lower()}"]
    return args


def lora_base(e: dict) -> Path:
    """Where an entry with `peft` finds its base: a Llama directory of its dims in the temp dir."""
    return Path(tempfile.gettempdir()) / f"bench-lora-base-{e['preset']}-l{e.get('n_layers') or 'all'}"


def write_lora_base(e: dict) -> Path:
    """The entry's base, random N(0, 0.02) bf16 weights (norms 1), written once (drawn on the GPU)."""
    out = lora_base(e)
    if (out / "config.json").is_file():
        return out
    from types import SimpleNamespace

    import torch

    sys.path.insert(0, str(ROOT))
    from mfsdp_launch.models.llama import hf_keys
    from mfsdp_launch.models.llama.dims import resolve_gpt_dims
    from mfsdp_launch.models.llama.hf_config import llama_config
    from mfsdp_launch.models.llama.hf_export import write_hf_dir

    dims = resolve_gpt_dims(SimpleNamespace(preset=e["preset"], n_layers=e.get("n_layers"), norm_eps=1e-5,
                                            rope_theta=10000.0))
    shapes = hf_keys.hf_shapes(dims)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def make(name):
        shape = shapes[name]
        if len(shape) == 1:
            return torch.ones(shape, dtype=torch.bfloat16)
        return (torch.randn(shape, device=device, dtype=torch.bfloat16) * 0.02).cpu()

    nbytes = {n: 2 * int(torch.Size(s).numel()) for n, s in shapes.items()}
    write_hf_dir(out, nbytes, make, llama_config(dims, dtype="bfloat16", max_position_embeddings=max(4096, e["seq"])))
    return out


# Packed SFT entries (`sft: docs|plain`): documents like NeMo Automodel's mock SFT data (lengths
# N(1024, 512) in [16, 4096], bench/peers/automodel_llama1b_packed_sft.yaml), each a prompt without
# targets (a quarter) and an answer with them, packed to train.seq_len from document starts.
SFT_DOCS = dict(mean=1024, std=512, low=16, high=4096, tokens=16_000_000)


def sft_corpus(e: dict) -> Path:
    vocab = hf_llama_config(e["preset"])["vocab_size"]  # (an HF_SHAPES name or a gpt preset)
    return Path(tempfile.gettempdir()) / f"bench-sft-corpus-v{vocab}"


def write_sft_corpus(e: dict) -> Path:
    """The entry's loss-masked corpus (a prepared directory with a mask stream), written once."""
    out = sft_corpus(e)
    if (out / "manifest.json").is_file():
        return out
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from mfsdp_launch.corpus import shards

    vocab = int(out.name.rsplit("-v", 1)[1])
    rng = np.random.default_rng(0)
    lengths = []
    while sum(lengths) < SFT_DOCS["tokens"]:
        lengths.append(int(np.clip(rng.normal(SFT_DOCS["mean"], SFT_DOCS["std"]), SFT_DOCS["low"], SFT_DOCS["high"])))
    tokens = rng.integers(1, vocab, size=sum(lengths), dtype=np.int64).astype(np.int32)
    ends = np.cumsum(lengths)
    tokens[ends - 1] = 0  # each document ends with EOS (id 0 here)
    mask = np.ones(len(tokens), dtype=np.uint8)
    for start, n in zip(ends - np.asarray(lengths), lengths):
        mask[start:start + n // 4] = 0  # the prompt
    out.mkdir(parents=True, exist_ok=True)
    entry = shards.write_shard(str(out), 0, tokens, lengths, mask=mask)
    meta = {"tokenizer": {"file": "synthetic", "sha256": "synthetic", "vocab_size": vocab}, "eos_id": 0,
            "dtype": "int32", "loss_mask": {"train_on": "assistant"}}
    shards.write_manifest(str(out), shards.build_manifest([entry], meta))
    return out


def data_args(e: dict) -> list:
    """Synthetic tokens, or for `sft` entries the packed SFT corpus: `docs` attends per document
    (data.doc_mask, varlen attention on the GPU), `plain` the same tokens with plain causal attention."""
    if not e.get("sft"):
        return ["data=synthetic"]
    return ["data=tokens", f"data.sources=[{{path: '{sft_corpus(e)}'}}]", "data.pack=documents",
            f"data.doc_mask={str(e['sft'] == 'docs').lower()}"]


def run_bounded(cmd: list, timeout: float, env: dict = None) -> subprocess.CompletedProcess:
    """Run `cmd` for at most `timeout` s. On expiry the process and every descendant (torchrun and
    the ranks, which sit in sessions of their own) get SIGKILL, so no rank keeps a GPU; the result
    then has returncode -9 and "timed out" on stderr."""
    sys.path.insert(0, str(ROOT))
    from mfsdp_launch.launcher.supervise import kill_tree

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
    if e.get("peft"):
        write_lora_base(e)
    if e.get("sft"):
        write_sft_corpus(e)
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
        from mfsdp_launch.rank.oom import LINE_RE

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
    from mfsdp_launch.planner.compose import compose
    from mfsdp_launch.core.errors import ConfigError
    from mfsdp_launch.launcher.launch import check
    from mfsdp_launch.planner.memory import GIB, estimate
    from mfsdp_launch.mesh import ParallelDims, world_size

    if e.get("sft"):  # validation opens the corpus
        write_sft_corpus(e)
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


def _gpus(r: dict, res: dict) -> str:
    """The row's GPU count, with its machine where it is not the one the header names."""
    card = str(r.get("device") or "").split("x ", 1)[-1]  # "1x NVIDIA H100 ..." -> "NVIDIA H100 ..."
    if not card or card == str(res.get("device", "")).split("x ", 1)[-1]:
        return str(r["world"])
    return f"{r['world']} ({card})"


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
                     f"{r['precision']} | {'yes' if r.get('fp8_params') else 'no'} | {_gpus(r, res)} | "
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
    lines += bench_report.report_lines(res["runs"], res.get("device", ""))  # peers, small models, issues 16 and 27
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
             "today's `mfsdp_launch/planner/memory.py` for the run's overrides; it aims at the **reserved** peak "
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
        est = estimate_entry(e, e.get("world", 2)).get("estimate_gib")
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


def list_matrix() -> int:
    """--list: each group with what it measures, then its entries (and what one measures, if said)."""
    for group, spec in GROUPS.items():
        print(f"{group}{' (memory)' if spec['memory'] else ''}: {spec['about']}".rstrip(": "))
        for name in spec["names"]:
            print(f"  {name}" + (f"  # {ABOUT[name]}" if name in ABOUT else ""))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--group", action="append", default=[], help=" | ".join([*GROUPS, "memory_reference"]))
    ap.add_argument("--only", action="append", default=[], help="entry names")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--log-interval", type=int, default=5)
    ap.add_argument("--report", action="store_true", help="only re-render results.md / throughput.png")
    ap.add_argument("--log", default=str(OUT / "bench.log"))
    ap.add_argument("--dry", action="store_true", help="print the planned runs and their memory estimates; run nothing")
    ap.add_argument("--world", type=int, default=2, help="GPUs assumed by --dry (default 2)")
    ap.add_argument("--list", action="store_true", help="print the matrix's groups and entries; run nothing")
    ap.add_argument("--tag", default="", help="suffix for the row names (keeps rows of other machines and calls apart)")
    a = ap.parse_args()
    if a.list:
        return list_matrix()
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
        device = f"{world}x {torch.cuda.get_device_name(0)}"
        # Each row names its machine; the header keeps the one most rows ran on (as --merge in
        # bench_peers.py): rows without their own device are rendered as the header's.
        res.setdefault("device", device)
        todo = [e for e in MATRIX if e["group"] in a.group or e["name"] in a.only]
        OUT.mkdir(exist_ok=True)
        with open(a.log, "a") as log:
            for e in todo:
                t0 = time.time()
                steps = e.get("steps", a.steps)
                if e.get("peft"):  # before the estimate: validation opens model.init_from's directory
                    write_lora_base(e)
                est = estimate_entry(e, world) if e["group"] in MEMORY_GROUPS else {}
                if est.get("refused"):  # refused before spawning: record it, spend no GPU time
                    r = dict(e, ok=False, world=world, error=est["refused"], **est)
                elif e["kind"] == "bare":
                    r = run_bare(e, world, steps if not e.get("profile") else 8, log)
                else:
                    r = run_launcher(e, world, steps, e.get("log_interval", a.log_interval), log)
                r.update(est)
                r["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
                r["device"] = device
                r["name"] = e["name"] + a.tag
                res["runs"][r["name"]] = r
                save_results(res)
                parts = [r["name"] + ":", "ok" if r.get("ok") else "FAILED"]
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
