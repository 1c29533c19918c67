"""scripts/bench_report.py: issues 16 and 27's now/after tables pick the right rows; bench/matrix.yaml is
well formed."""

from __future__ import annotations

import sys

from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import bench_report  # noqa: E402


def _row(name, tps, **kw):
    return dict(dict(name=name, ok=True, tokens_per_s_per_gpu=tps, mfu=tps / 20000, kind="launcher"), **kw)


def test_after_is_the_best_comparable_row():
    te8b = dict(model="te_gpt", preset="8b", seq=8192, precision="delayed")
    runs = {r["name"]: r for r in [
        _row("a_ga8", 13800, ga=8, **te8b),
        _row("b_ga16", 14100, ga=16, **te8b),
        _row("c_tp2", 16000, ga=8, tp=2, **te8b),  # another layout: not the workload
        _row("c_l8_1gpu", 30000, ga=8, n_layers=8, world=1, **te8b),  # a slice of the model on one GPU
        _row("d_ga1", 12700, **te8b),
        _row("e_failed", 20000, ga=8, **dict(te8b, ok=False)),
    ]}
    table = {line.split(" | ")[0].lstrip("| "): line for line in bench_report.goal_table(runs) if line.startswith("| ")}
    assert "`b_ga16`" in table["te_gpt 8b FP8, dp_shard=2, seq 8192, mbs 1, grad_accum >= 8"]
    assert "`d_ga1`" in table["same, grad_accum 1"]
    assert "not measured" in table["gpt 8b bf16, seq 4096, mbs 1"]
    assert len(table) == len(bench_report.GOALS) + 1  # + the header row


def test_each_peer_meets_our_fastest_row_of_its_workload_and_call():
    """results.md's peers notes: a torchtitan row is held against our fastest row of the same model
    size, seq, micro-batch, GPUs, precision and compile mode from the same call; never against a row
    of another workload, another call or a profiled run."""
    w = dict(group="peers", preset="1.4b", seq=2048, mbs=4, world=1, precision="bf16", device="1x H100")
    at = lambda minute: f"2026-12-06T11:{minute:02d}:00"  # noqa: E731
    runs = {r["name"]: r for r in [
        _row("tt_c", 40000, kind="peer", engine="torchtitan + compile", measured_at=at(20), **w),
        _row("tt_e", 36000, kind="peer", engine="torchtitan", measured_at=at(20), **w),
        _row("ours_c", 48000, extra=["train.compile=true"], measured_at=at(22), **w),
        _row("ours_c_slower", 46000, extra=["train.compile=true"], measured_at=at(23), **w),
        _row("ours_e", 39600, measured_at=at(24), **w),
        _row("ours_c_prof", 90000, extra=["train.compile=true", "train.profile={start: 5, steps: 1}"],
             measured_at=at(22), **w),
        _row("moe_c", 99000, extra=["train.compile=true"], measured_at=at(21), **dict(w, preset="moe")),
        _row("ours_c_later", 99000, extra=["train.compile=true"], measured_at=at(50), **w),
    ]}
    notes = {line.split(" (")[0].strip("- "): line for line in bench_report.peer_notes(runs)[1:]}
    assert "ours ours_c 48,000: **1.200x** (goal >= 1.2x)" in notes["tt_c"], notes
    assert "ours ours_e 39,600: **1.100x** (goal >= 1.05x)" in notes["tt_e"], notes
    runs["ours_c"]["device"] = runs["ours_c_slower"]["device"] = "1x H200"  # another machine's rows
    assert "no row of ours" in {line.split(" (")[0].strip("- "): line
                                for line in bench_report.peer_notes(runs)[1:]}["tt_c"]


def test_matrix_entries_are_unique_and_every_override_is_key_value():
    """bench/matrix.yaml: each group/name once (results.json keys its rows by name), every override
    an entry adds (each key once; it may replace one of the run's defaults, which come first) and
    every one its run passes is key=value; the rows this page names are in the matrix."""
    import re

    import bench
    import bench_matrix
    import yaml

    raw = yaml.safe_load(bench_matrix.PATH.read_text())["groups"]
    pairs = [(group, e["name"]) for group, spec in raw.items() for e in spec["entries"]]
    assert len(set(pairs)) == len(pairs) and len({name for _, name in pairs}) == len(pairs)
    assert [(e["group"], e["name"]) for e in bench.MATRIX] == pairs
    key_value = re.compile(r"\+?[A-Za-z_][\w.]*=\S.*")  # (+recipe=NAME adds to the defaults list)
    for e in bench.MATRIX:
        extra = e.get("extra", [])
        assert all(key_value.fullmatch(x) for x in extra), (e["name"], extra)
        assert len({x.split("=", 1)[0] for x in extra}) == len(extra), (e["name"], extra)
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in e.get("env", {}).items()), e["name"]
        if e["kind"] == "launcher" and e["model"] != "hf":  # (hf builds its config from the package)
            args = bench.launcher_args(e, 2, 10, 5, ROOT / "runs" / e["name"])
            assert all(key_value.fullmatch(a) for a in args) and set(extra) <= set(args), (e["name"], args)
    named = {"mfsdp_te_gpt_2b_bf16_mbs4", "now_te_gpt_8b_hfsdp_delayed_s4096", "now_te_gpt_8b_hfsdp_bf16_s4096",
             "now_gpt_8b_bf16_s4096", "te8b_opt_ref", "te8bl8_ref"}
    assert named <= {name for _, name in pairs}
    assert bench.MEMORY_GROUPS[-1] == "memory_reference" and set(bench.MEMORY_GROUPS[:-1]) <= set(raw)


def test_recipe_entries_say_what_their_recipe_holds():
    """An entry with `recipe` runs the recipe as shipped; its model fields (the row's description in
    results.json and memory.md) are the recipe's own, and every GPU recipe has one."""
    import bench
    from mfsdp_launch.planner import prepare

    rows = [e for e in bench.MATRIX if e.get("recipe")]
    assert {e["recipe"] for e in rows} >= {"fsdp_bf16", "hsdp_bf16", "hfsdp_bf16", "hfsdp_fp8"}
    for e in rows:
        args = bench.launcher_args(e, 1, e["steps"], e["log_interval"], ROOT / "runs" / e["name"])
        cfg, _ = prepare([*args, "launcher.dry_run=true"], check_hardware=False)
        precision = "bf16" if str(cfg.fp8.recipe) == "none" else str(cfg.fp8.recipe)
        held = (cfg.model.name, cfg.model.preset, cfg.train.seq_len, cfg.train.micro_batch_size, precision)
        assert held == (e["model"], e["preset"], e["seq"], e["mbs"], e["precision"]), e["name"]
        assert cfg.train.steps == e["steps"] and cfg.checkpoint.save_final is False, e["name"]


def test_issue27_after_is_the_best_row_on_each_kind_of_gpu():
    """Issue 27's table: per workload, the best comparable one-GPU row on each GPU kind (a row without
    a device ran on the page's), never a profiled, failed, 2-GPU or overridden-recipe row; the peers'
    ratio only from one call; launcher_X over bare_X."""
    gpt = dict(model="gpt", preset="1.4b", seq=2048, precision="bf16", world=1)
    h100 = dict(device="1x NVIDIA H100 80GB HBM3")
    peer = dict(group="peers", preset="1.4b", seq=2048, mbs=4, world=1, precision="bf16", **h100)
    at = lambda minute: f"2026-12-06T11:{minute:02d}:00"  # noqa: E731
    runs = {r["name"]: r for r in [
        _row("gpt_h200", 11000, **gpt),
        _row("gpt_h100", 12000, **gpt, **h100),
        _row("gpt_h100_slower", 11500, **gpt, **h100),
        _row("gpt_prof", 19000, extra=["train.profile={start: 6, steps: 1}"], **gpt, **h100),
        _row("gpt_2gpu", 19000, **dict(gpt, world=2)),
        _row("gpt_failed", 19000, **dict(gpt, ok=False)),
        _row("recipe_fsdp_bf16", 9000, recipe="fsdp_bf16", **gpt),
        _row("recipe_fsdp_bf16_tuned", 10500, recipe="fsdp_bf16", extra=["train.micro_batch_size=8"], **gpt),
        _row("te8b_ga8", 54000, model="te_gpt", preset="8b", n_layers=8, seq=8192, mbs=1, ga=8, world=1, **h100),
        _row("te8b_ga1", 60000, model="te_gpt", preset="8b", n_layers=8, seq=8192, mbs=1, world=1, **h100),
        _row("tt", 40000, kind="peer", engine="torchtitan", measured_at=at(20), **peer),
        _row("ours", 46000, measured_at=at(21), **peer),
        _row("ours_other_call", 60000, measured_at=at(50), **peer),
        _row("launcher_x_pair1", 9900, **gpt), _row("bare_x_pair1", 10000, kind="bare", **gpt),
    ]}
    table = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[2]
             for line in bench_report.goal_table_27(runs, "1x NVIDIA H200") if line.startswith("| ")}
    best = table["gpt 1.4b bf16, seq 2048, one GPU, best MFU"]
    assert best.startswith("H200: 11,000") and "H100: 12,000" in best and "`gpt_h100`" in best, best
    assert "`recipe_fsdp_bf16`" in table[next(k for k in table if k.startswith("`+recipe=fsdp_bf16`"))]
    assert "tuned" not in table[next(k for k in table if k.startswith("`+recipe=fsdp_bf16`"))]
    assert "`te8b_ga8`" in table["te_gpt 8b's layer x 8, FP8, seq 8192, 65k tokens a step, one GPU"]
    eager = table["gpt 1.4b bf16, seq 2048, mbs 4, eager: ours / torchtitan eager, same call"]
    assert "H100: 46,000 / 40,000 = **1.150x**" in eager, eager
    assert table["the same compiled: ours / torchtitan `--compile.enable`"] == "not measured"
    pair = table[next(k for k in table if k.startswith("launcher / bare loop"))]
    assert pair == "**0.990x** (`launcher_x_pair1`, H200)", pair
