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
  python3 scripts/bench.py --report               # re-render md/png from results.json
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


def gpus() -> int:
    import torch

    return torch.cuda.device_count()


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def launcher_args(e: dict, world: int, steps: int, log_interval: int, run_dir: Path) -> list:
    if e["model"] == "hf":  # the preset's dims as an HF config
        model_args = ["model=hf", "model.hf_class=LlamaForCausalLM",
                      f"model.hf_config={hydra_dict(hf_llama_config(e['preset']))}"]
    else:
        model_args = [f"model={e['model']}", f"model.preset={e['preset']}"]
    args = [
        f"engine={e['engine']}", *model_args, "model.init_on_meta=true",
        "data=synthetic", f"train.steps={steps}", f"train.log_interval={log_interval}",
        f"train.seq_len={e['seq']}", f"train.micro_batch_size={e['mbs']}", "train.progress=false",
        "precision.compute_dtype=bf16", "precision.main_params_dtype=fp32", "precision.main_grads_dtype=fp32",
        "sharding.zero_dp_strategy=optim_grads_params", "sharding.outer_dp_sharding_strategy=no_shard",
        "mesh.dp_outer=1", "mesh.dp_shard=-1", f"launcher.nproc_per_node={world}",
        "checkpoint.save_final=false", "checkpoint.resume=never", f"run.dir={run_dir}",
    ]
    if e["model"] == "te_gpt":
        args.append("model.params_dtype=bf16")
    if e.get("n_layers"):
        args.append(f"model.n_layers={e['n_layers']}")
    if e["precision"] != "bf16":
        args += [f"fp8.recipe={e['precision']}", f"fp8.params={str(e['fp8_params']).lower()}",
                 f"engine.keep_fp8_transpose_cache={str(e['fp8_params']).lower()}"]
    return args


def run_launcher(e: dict, world: int, steps: int, log_interval: int, log) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-{e['name']}-"))
    cmd = [sys.executable, "-m", "mfsdp_launch", *launcher_args(e, world, steps, log_interval, run_dir)]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    log.write(f"\n=== {e['name']} ({time.time() - t0:.0f} s, exit {proc.returncode})\n$ {' '.join(cmd)}\n"
              f"{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}\n")
    log.flush()
    rows = []
    if (run_dir / "metrics.jsonl").exists():
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    if proc.returncode != 0 or not rows:
        return dict(e, ok=False, error=(proc.stderr or proc.stdout)[-800:], world=world)
    use = rows[1:] or rows
    return dict(e, ok=True, world=world,
                tokens_per_s_per_gpu=statistics.median(r["tokens_per_s_per_gpu"] for r in use),
                mfu=statistics.median(r["mfu"] for r in use) if use[0]["mfu"] is not None else None,
                peak_mem_gib=max(r["peak_mem_gib"] for r in rows),
                step_time_s=statistics.median(r["step_time_s"] for r in use),
                loss=rows[-1]["loss"], rows=len(rows), wall_s=round(time.time() - t0, 1))


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
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    log.write(f"\n=== {e['name']} ({time.time() - t0:.0f} s, exit {proc.returncode})\n$ {' '.join(cmd)}\n"
              f"{proc.stdout[-20000:]}\n{proc.stderr[-4000:]}\n")
    log.flush()
    for line in proc.stdout.splitlines():
        if line.startswith("BENCH_JSON "):
            got = json.loads(line[len("BENCH_JSON "):])
            got.pop("name", None)
            return dict(e, **got, ok=True, wall_s=round(time.time() - t0, 1))
    return dict(e, ok=False, error=(proc.stderr or proc.stdout)[-800:], world=world)


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
        if r.get("profile"):
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--group", action="append", default=[], help="gpt | gpt_pair | te | te_deep | te_more | te_profile | hf_vs_gpt")
    ap.add_argument("--only", action="append", default=[], help="entry names")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--log-interval", type=int, default=5)
    ap.add_argument("--report", action="store_true", help="only re-render results.md / throughput.png")
    ap.add_argument("--log", default=str(OUT / "bench.log"))
    a = ap.parse_args()
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
                if e["kind"] == "bare":
                    r = run_bare(e, world, steps if not e.get("profile") else 8, log)
                else:
                    r = run_launcher(e, world, steps, e.get("log_interval", a.log_interval), log)
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
                parts.append(f"({time.time() - t0:.0f} s)")
                print(" ".join(parts), flush=True)
                if not r.get("ok"):
                    print("   " + r.get("error", "")[-600:].replace("\n", "\n   "), flush=True)
    render(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
