"""The issues' scoreboards under bench/results.md: each workload's figure when issue 16 or 27 was
filed ("now") next to the best row measured since ("after"), and the notes of the peers and
small-model groups. Pure functions over results.json's rows (no torch, no bench import), called by
scripts/bench.py's `render`, so every script that re-renders results.md writes the same page.
"""

from __future__ import annotations

from datetime import datetime
from typing import Callable, Dict, List, Optional, Tuple

Rows = Dict[str, dict]
PEERS, SMALL = "peers", "small"


def _ok(runs: Rows) -> List[dict]:
    return [r for r in runs.values() if r.get("ok") and r.get("tokens_per_s_per_gpu")]


def _best(rows: List[dict], key: str = "tokens_per_s_per_gpu") -> Optional[dict]:
    rows = [r for r in rows if r.get(key) is not None]
    return max(rows, key=lambda r: r[key]) if rows else None


def _tps(r: Optional[dict]) -> str:
    if not r:
        return "not measured"
    mfu = f", {100 * r['mfu']:.1f} % MFU" if r.get("mfu") is not None else ""
    changes = [x for x in r.get("extra", []) if not x.startswith("train.profile")]  # what differs from "now"
    if r.get("zero", 3) != 3:
        changes.append(f"sharding.zero_dp_strategy={r['zero']}")
    how = f": {', '.join(f'`{c}`' for c in changes)}" if changes else ""
    note = "; see the row's note in results.json" if r.get("note") else ""
    return f"{r['tokens_per_s_per_gpu']:,.0f}{mfu} (`{r['name']}`{how}{note})"


def _te8b(runs: Rows, ga_min: int) -> Optional[dict]:
    return _best([r for r in _ok(runs) if r.get("model") == "te_gpt" and r.get("preset") == "8b"
                  and r.get("seq") == 8192 and r.get("tp", 1) == 1 and r.get("cp", 1) == 1
                  and not r.get("n_layers") and r.get("world", 2) == 2 and not r.get("outer")
                  and (r.get("ga", 1) >= ga_min if ga_min > 1 else r.get("ga", 1) == 1)])


def _named(runs: Rows, *names: str) -> Optional[dict]:
    return _best([r for r in _ok(runs) if r["name"] in names])


def _gpt_1p4b(runs: Rows, model: str = "gpt", **match) -> Optional[dict]:
    rows = [r for r in _ok(runs) if r.get("model") == model and r.get("preset") == "1.4b"
            and r.get("precision") == "bf16" and r.get("tp", 1) == 1 and r.get("kind") == "launcher"
            and r.get("world", 2) == 2
            and all(r.get(k) == v for k, v in match.items())]
    return _best(rows, "mfu")


def _fp8_gain(runs: Rows) -> str:
    bf16 = _named(runs, "mfsdp_te_gpt_2b_bf16_mbs4")
    fp8 = _best([r for r in _ok(runs) if r["name"].startswith("mfsdp_te_gpt_2b_") and r["name"].endswith("_mbs4")
                 and r.get("precision") != "bf16" and not r.get("fp8_params")])
    if not (bf16 and fp8):
        return "not measured"
    return f"{fp8['tokens_per_s_per_gpu'] / bf16['tokens_per_s_per_gpu']:.2f}x (`{fp8['name']}` / `{bf16['name']}`)"


def _small_groups(runs: Rows) -> Dict[Tuple[str, int], List[dict]]:
    """The small-model group's rows with an MFU, by (model, GPUs), in the order the notes list them."""
    ok = [r for r in _ok(runs) if r.get("group") == SMALL and r.get("mfu") is not None]
    groups = {(model, world): [r for r in ok if r["model"] == model and r["world"] == world]
              for model in ("gpt", "te_gpt") for world in (1, 2)}
    return {k: rows for k, rows in groups.items() if rows}


def _small(runs: Rows) -> str:
    parts = [f"{model} {world} GPU: {100 * _best(rows, 'mfu')['mfu']:.1f} %"
             for (model, world), rows in _small_groups(runs).items()]
    return ", ".join(parts) + " MFU (`scripts/bench_small.py`)" if parts else "not measured"


# (workload, now: the figure on 2x H200, after: a function of the rows, reference / goal)
GOALS: List[Tuple[str, str, Callable[[Rows], str], str]] = [
    ("te_gpt 8b FP8, dp_shard=2, seq 8192, mbs 1, grad_accum >= 8", "13,733",
     lambda runs: _tps(_te8b(runs, 8)),
     "goal >= 15,000; Megatron-Bridge Llama3 8B FP8 + Megatron-FSDP, 8x H100: 14,451 (published)"),
    ("same, grad_accum 1", "12,865", lambda runs: _tps(_te8b(runs, 1)), ""),
    ("te_gpt 8b, HFSDP (dp_outer=2, dp_shard=1), seq 4096, FP8 delayed", "10,493",
     lambda runs: _tps(_named(runs, "now_te_gpt_8b_hfsdp_delayed_s4096")), ""),
    ("same, bf16", "8,272", lambda runs: _tps(_named(runs, "now_te_gpt_8b_hfsdp_bf16_s4096")), ""),
    ("gpt 1.4b bf16 ZeRO-3, seq 2048, mbs 4, eager (the peers' settings)", "41,464 (37.7 % MFU)",
     lambda runs: _tps(_gpt_1p4b(runs, seq=2048, mbs=4, group=PEERS, engine="megatron_fsdp")),
     "torchtitan 0.3.0 on the same model and GPUs: 38,590; Automodel FSDP2: 32,900 (when the issue was filed)"),
    ("gpt 1.4b bf16, our best settings", "37.7 % MFU", lambda runs: _tps(_gpt_1p4b(runs)), "goal >= 50 % MFU"),
    ("the same 1.4b on TE layers (te_gpt: fused norm, SwiGLU, RoPE), bf16", "",
     lambda runs: _tps(_gpt_1p4b(runs, model="te_gpt")), "goal >= 50 % MFU"),
    ("gpt 8b bf16, seq 4096, mbs 1", "7,850 (40.9 % MFU)", lambda runs: _tps(_named(runs, "now_gpt_8b_bf16_s4096")),
     "torchtitan 8B bf16 FSDP, 8x H100, seq 8192: 5,762 (published)"),
    ("125M gpt / te_gpt (recipes as shipped: mbs 4, eager)", "5-14 % MFU", _small, "goal >= 25 % MFU"),
    ("te_gpt d=4096 8 layers, best FP8 / bf16", "1.45x", _fp8_gain, ""),
]


def goal_table(runs: Rows) -> List[str]:
    lines = ["## Issue 16: now and after", "",
             "\"now\": the figure when the issue was filed (2x H200, `mfsdp-train`); \"after\": the best row of "
             "this page for the same workload (tokens/s/GPU, MFU against the bf16 peak).", "",
             "| workload | now | after | reference / goal |", "|---|---|---|---|"]
    for workload, now, after, ref in GOALS:
        lines.append(f"| {workload} | {now} | {after(runs)} | {ref} |")
    return lines


def _compiled(r: dict) -> bool:
    return "+ compile" in r.get("engine", "") or "train.compile=true" in r.get("extra", [])


def _profiled(r: dict) -> bool:
    return r["name"].endswith("_prof") or "_prof_" in r["name"] or any(
        x.startswith("train.profile") for x in r.get("extra", []))


def _same_call(a: dict, b: dict, minutes: float = 12.0) -> bool:
    """Measured on the same kind of GPU within `minutes`: one device call (bench_peers.py interleaves
    a call's runs, and a call lasts at most 10 minutes)."""
    if a.get("device", "") != b.get("device", "") or not (a.get("measured_at") and b.get("measured_at")):
        return False
    gap = datetime.fromisoformat(a["measured_at"]) - datetime.fromisoformat(b["measured_at"])
    return abs(gap.total_seconds()) <= 60 * minutes


# Issue 27's goals against torchtitan on the same workload: compiled and eager
PEER_GOALS = {True: 1.2, False: 1.05}


def peer_pairs(runs: Rows) -> List[Tuple[dict, Optional[dict]]]:
    """Each peer row with our fastest row of the same workload (model size, seq, micro-batch, GPUs,
    precision, compiled or not) measured in the same call, or None; profiled runs of either side left out."""
    ok = [r for r in _ok(runs) if r.get("group") == PEERS and not _profiled(r)]
    ours, peers = [r for r in ok if r.get("kind") == "launcher"], [r for r in ok if r.get("kind") == "peer"]
    keys = ("preset", "seq", "mbs", "world", "precision")
    return [(p, _best([r for r in ours if all(r.get(k) == p.get(k) for k in keys)
                       and _compiled(r) == _compiled(p) and _same_call(r, p)]))
            for p in sorted(peers, key=lambda r: r["name"])]


def peer_notes(runs: Rows) -> List[str]:
    """Each peer row against our fastest row of its workload and call (peer_pairs)."""
    lines = []
    for p, mine in peer_pairs(runs):
        goal = PEER_GOALS[_compiled(p)]
        where = f"{p.get('preset')} seq {p.get('seq')} mbs {p.get('mbs')}, {p.get('world', 1)} GPU(s)"
        if mine is None:
            lines.append(f"  - {p['name']} ({p['engine']}, {where}): {p['tokens_per_s_per_gpu']:,.0f}; no row of ours "
                         "from the same call")
            continue
        lines.append(f"  - {p['name']} ({p['engine']}, {where}): {p['tokens_per_s_per_gpu']:,.0f}; ours "
                     f"{mine['name']} {mine['tokens_per_s_per_gpu']:,.0f}: "
                     f"**{mine['tokens_per_s_per_gpu'] / p['tokens_per_s_per_gpu']:.3f}x** (goal >= {goal}x)")
    return ["- peers: each against our fastest row of the same workload, measured within 12 minutes on the same "
            "kind of GPU", *lines] if lines else []


def small_notes(runs: Rows) -> List[str]:
    """Per model and GPU count: the shipped recipe's setting (mbs 4, eager) and the best row's MFU."""
    lines = []
    for (model, world), rows in _small_groups(runs).items():
        best = _best(rows, "mfu")
        base = next((r for r in rows if r["mbs"] == 4 and r.get("variant") == "eager"), None)
        start = f"mbs 4 eager {100 * base['mfu']:.1f}% -> " if base else ""
        lines.append(f"- {model} 125m on {world} GPU(s): {start}best {best['name']} **{100 * best['mfu']:.1f}% MFU** "
                     f"({best['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU; goal >= 25%)")
    return lines


def change_notes(runs: Rows, prefix: str, label: str) -> List[str]:
    """Each `<prefix>_*` row against `<prefix>_ref`, measured in the same call."""
    ref = _named(runs, f"{prefix}_ref")
    rows = sorted((r for r in _ok(runs) if r["name"].startswith(prefix + "_") and r is not ref
                   and not r["name"].endswith("_profile")), key=lambda r: r["name"])  # (profiled: slower)
    if not ref or not rows:
        return []
    each = ", ".join(f"{r['name'][len(prefix) + 1:]} {r['tokens_per_s_per_gpu'] / ref['tokens_per_s_per_gpu']:.3f}x "
                     f"({r['peak_mem_gib']:.1f} GiB)" for r in rows)
    return [f"- {label}: ref {ref['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU ({ref['peak_mem_gib']:.1f} GiB); {each}"]


def _gpu(r: dict, header: str) -> str:
    """The GPU a row ran on: its own device, else the page's (rows from before rows named theirs)."""
    device = r.get("device") or header
    return next((g for g in ("H100", "H200", "B200") if g in device), device or "?")


def _one_gpu(runs: Rows, **match) -> List[dict]:
    """Our rows on one GPU that match (profiled ones left out: the profiler slows them)."""
    return [r for r in _ok(runs) if r.get("kind") == "launcher" and r.get("world") == 1 and not _profiled(r)
            and all(r.get(k) == v for k, v in match.items())]


def _h200_first(by_gpu: Dict[str, object]) -> List[str]:
    return sorted(by_gpu, key=lambda gpu: gpu != "H200")


def _best_on_each_gpu(rows: List[dict], header: str, key: str) -> str:
    """The best row per GPU kind, H200 first (the issue's machine)."""
    by_gpu: Dict[str, List[dict]] = {}
    for r in rows:
        by_gpu.setdefault(_gpu(r, header), []).append(r)
    cells = [f"{gpu}: {_tps(_best(by_gpu[gpu], key))}" for gpu in _h200_first(by_gpu)]
    return "; ".join(cells) or "not measured"


def _recipes(names: Tuple[str, ...]) -> Callable[[Rows, str], str]:
    """Each recipe as shipped (no override but its length) on one GPU: its best row per GPU kind."""
    def cell(runs: Rows, header: str) -> str:
        shipped = {n: [r for r in _one_gpu(runs, recipe=n) if not r.get("extra")] for n in names}
        return " / ".join(f"`{n}` {_best_on_each_gpu(rows, header, 'mfu')}" for n, rows in shipped.items())
    return cell


def _vs_peer(compiled: bool) -> Callable[[Rows, str], str]:
    """Our best ratio to torchtitan on the 1.4b gpt, one GPU, in one call (peer_pairs), per GPU kind."""
    def cell(runs: Rows, header: str) -> str:
        best: Dict[str, Tuple[float, dict, dict]] = {}
        for p, mine in peer_pairs(runs):
            workload = (p.get("preset"), p.get("seq"), p.get("mbs"), p.get("world"))
            if mine is None or _compiled(p) != compiled or workload != ("1.4b", 2048, 4, 1):
                continue
            ratio = mine["tokens_per_s_per_gpu"] / p["tokens_per_s_per_gpu"]
            gpu = _gpu(p, header)
            if gpu not in best or ratio > best[gpu][0]:
                best[gpu] = (ratio, mine, p)
        cells = []
        for gpu in _h200_first(best):
            ratio, m, p = best[gpu]
            cells.append(f"{gpu}: {m['tokens_per_s_per_gpu']:,.0f} / {p['tokens_per_s_per_gpu']:,.0f} = "
                         f"**{ratio:.3f}x** (`{m['name']}` / `{p['name']}`)")
        return "; ".join(cells) or "not measured"
    return cell


def _launcher_over_bare(runs: Rows, header: str) -> str:
    """launcher_X / bare_X, each pair of scripts/bench.py's gpt_pair group (interleaved in one call)."""
    ok = {r["name"]: r for r in _ok(runs)}
    cells = []
    for name in sorted(ok):
        bare = ok.get("bare_" + name[len("launcher_"):]) if name.startswith("launcher_") else None
        if bare and "before" not in name:  # (`_before_<change>` rows: the pair before a change landed)
            ratio = ok[name]["tokens_per_s_per_gpu"] / bare["tokens_per_s_per_gpu"]
            cells.append(f"**{ratio:.3f}x** (`{name}`, {_gpu(ok[name], header)})")
    return ", ".join(cells) or "not measured"


GPT14 = dict(preset="1.4b", seq=2048, precision="bf16")
# (workload, now: the figure on one H200, after: a function of the rows and the page's GPU, goal)
GOALS_27: List[Tuple[str, str, Callable[[Rows, str], str], str]] = [
    ("`+recipe=fsdp_bf16` / `hsdp_bf16` / `hfsdp_bf16` as shipped, one GPU",
     "117-147k tokens/s, 10-13 % MFU (gpt 125M, mbs 4, eager)", _recipes(("fsdp_bf16", "hsdp_bf16", "hfsdp_bf16")),
     "goal 1: >= 35 % MFU"),
    ("`+recipe=hfsdp_fp8` as shipped, one GPU", "68.7k tokens/s, 84 % MFU (bf16 peak)", _recipes(("hfsdp_fp8",)),
     "goal 1: >= 35 % MFU"),
    ("gpt 1.4b bf16, seq 2048, mbs 4, eager: ours / torchtitan eager, same call", "42,553 / 44,217 = 0.96x",
     _vs_peer(compiled=False), "goal 2: >= 1.05x"),
    ("the same compiled: ours / torchtitan `--compile.enable`", "53,686 / 48,037 = 1.118x", _vs_peer(compiled=True),
     "goal 2: >= 1.2x"),
    ("gpt 1.4b bf16, seq 2048, one GPU, best MFU", "55,784, 50.8 % MFU (mbs 8, compile + fused loss)",
     lambda runs, header: _best_on_each_gpu(_one_gpu(runs, model="gpt", **GPT14), header, "mfu"),
     "goal 3: >= 60 % MFU"),
    ("te_gpt 1.4b bf16, seq 2048, one GPU, best MFU", "61,570, 56.0 % MFU (mbs 8, fused loss, FusedAdam, grad_accum 4)",
     lambda runs, header: _best_on_each_gpu(_one_gpu(runs, model="te_gpt", **GPT14), header, "mfu"),
     "goal 3: >= 65 % MFU"),
    ("te_gpt 8b's layer x 8, FP8, seq 8192, 65k tokens a step, one GPU", "54,204 (ref 48,325)",
     lambda runs, header: _best_on_each_gpu([r for r in _one_gpu(runs, model="te_gpt", preset="8b", n_layers=8,
                                                                  seq=8192) if r.get("mbs", 1) * r.get("ga", 1) == 8],
                                            header, "tokens_per_s_per_gpu"),
     "goal 4: >= 62,000 tokens/s"),
    ("launcher / bare loop (`scripts/bare_loop.py`), gpt 1.4b eager, interleaved", "", _launcher_over_bare,
     "goal 5: >= 0.99x"),
]


def goal_table_27(runs: Rows, header: str = "") -> List[str]:
    lines = ["## Issue 27: now and after", "",
             "\"now\": the figure when the issue was filed (one H200, `mfsdp-train`); \"after\": the best row of "
             "this page for the same workload on each kind of GPU it ran on (tokens/s/GPU, MFU against the bf16 "
             "peak). "
             "Goal 6 (MFU at the GEMMs' precision as well) is in every FP8 run's log line.", "",
             "| workload | now | after | goal |", "|---|---|---|---|"]
    lines += [f"| {workload} | {now} | {after(runs, header)} | {goal} |" for workload, now, after, goal in GOALS_27]
    return lines


def report_lines(runs: Rows, header: str = "") -> List[str]:
    """Everything results.md shows under the run table; `header` is the page's GPU (rows without
    their own device ran on it)."""
    notes = (peer_notes(runs) + small_notes(runs)
             + change_notes(runs, "te8bl8", "te_gpt 8b's layer x 8, FP8 delayed, seq 8192, grad_accum 8, one GPU")
             + change_notes(runs, "te8b_opt", "te_gpt 8b FP8 delayed, seq 8192, grad_accum 8, 2 GPUs"))
    return [*notes, "", *goal_table(runs), "", *goal_table_27(runs, header)]

