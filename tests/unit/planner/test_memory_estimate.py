"""The per-rank memory estimate (planner/memory.py) against the peaks measured on H200s
(bench/memory_reference.json, the one table of them), its structure (monotonic in AC, tp, cp, ZeRO
stage, FP8 weights), and scripts/bench.py's memory groups: `--dry` plans and estimates on a CPU
machine, and a bounded run leaves no process behind. Torch-free."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from helpers import ROOT, cli_env

sys.path.insert(0, str(ROOT / "scripts"))
import bench  # noqa: E402

from mfsdp_launch.planner import prepare  # noqa: E402
from mfsdp_launch.planner.memory import GIB, estimate  # noqa: E402
from mfsdp_launch.mesh import ParallelDims  # noqa: E402

TOLERANCE = 0.15  # issue 15: within +-15 % of measured


@pytest.mark.parametrize("point", bench.memory_reference(), ids=lambda p: p["name"])
def test_estimate_is_within_15_percent_of_each_measured_peak(point):
    got = bench.estimate_entry(point, world=point.get("world", 2))
    assert "refused" not in got, got
    ratio = got["estimate_gib"] / point["measured_gib"]
    assert abs(ratio - 1) <= TOLERANCE, f"{point['name']}: estimate {got['estimate_gib']:.1f} GiB vs measured " \
                                        f"{point['measured_gib']} GiB ({got['parts']})"


RESERVED = bench.reserved_points(bench.load_results())


@pytest.mark.parametrize("run", RESERVED, ids=lambda r: r["name"])
def test_estimate_is_within_15_percent_of_each_measured_reserved_peak(run):
    """bench/memory.md's runs (reserved peaks measured on H200s), estimated by today's planner/memory.py."""
    ratio = bench.current_estimate(run) / run["peak_reserved_gib"]
    assert abs(ratio - 1) <= TOLERANCE, f"{run['name']}: {ratio:.2f}"


def test_fsdp2_tensor_parallel_reserves_a_gradient_copy():
    # measured: 1.22-1.33x reserved over allocated under FSDP2 + TP, 1.03-1.09x without TP
    tp1, tp2 = _est("engine=fsdp2"), _est("engine=fsdp2", "mesh.tp=2", world=4)
    mf_tp2 = _est("model=te_gpt", "mesh.tp=2", world=4)
    assert tp2.allocator - tp1.allocator > 0.9 * tp2.main_params  # one fp32 gradient per main weight
    assert mf_tp2.allocator < 0.1 * mf_tp2.main_params  # Megatron-FSDP's gradient buffer is persistent


def _est(*overrides, world=2, dims=None):
    base = ["model=gpt", "model.preset=8b", "train.seq_len=4096", "train.micro_batch_size=1", "engine=megatron_fsdp",
            "precision.compute_dtype=bf16", "precision.main_grads_dtype=fp32", f"launcher.nproc_per_node={world}",
            "launcher.dry_run=true", "model.init_on_meta=true"]
    cfg, _ = prepare([*base, *overrides], check_hardware=False)
    return estimate(cfg, dims or ParallelDims.from_config(cfg.mesh, world))


def test_monotonic_in_activation_checkpointing():
    none, sel, full = (_est(f"model.activation_checkpointing={m}") for m in ("none", "selective", "full"))
    assert full.total < sel.total < none.total
    assert full.activations < 0.2 * none.activations
    assert full.logits == none.logits  # the loss's buffers are not checkpointed


def test_monotonic_in_zero_stage():
    totals = [_est(f"sharding.zero_dp_strategy={z}").total for z in (1, 2, 3)]
    assert totals[0] > totals[1] > totals[2]


def test_tensor_parallel_splits_blocks_not_the_head():
    one, two = _est("engine=fsdp2"), _est("engine=fsdp2", "mesh.tp=2", world=4)  # both dp_shard=2
    assert two.total < one.total and two.activations < one.activations
    assert two.logits == one.logits  # the head stays whole on every tp rank


def test_fused_loss_holds_bf16_logits_not_fp32_buffers():
    torch_ce, fused = _est("model=te_gpt"), _est("model=te_gpt", "model.loss_kernel=te_fused")
    assert fused.logits == pytest.approx(torch_ce.logits / 3) and fused.activations == torch_ce.activations


def test_context_parallel_divides_tokens_per_rank():
    # (gpt's cp is validated elsewhere; the estimate follows the mesh whatever the model)
    one = _est("train.seq_len=32768")
    two = _est("train.seq_len=32768", dims=ParallelDims(1, 1, 2, 1))  # the same 2 ranks shard the state
    assert two.total < one.total and two.main_params == one.main_params
    assert two.activations == pytest.approx(one.activations / 2, rel=1e-6)
    assert two.logits == pytest.approx(one.logits / 2, rel=1e-6)


def test_fp8_weights_cost_until_they_are_the_params():
    bf16 = _est("model=te_gpt")
    fp8 = _est("model=te_gpt", "fp8.recipe=delayed")
    fp8_params = _est("model=te_gpt", "fp8.recipe=delayed", "fp8.params=true", "engine.keep_fp8_transpose_cache=true")
    assert fp8.fp8_weights > 0 and fp8.total > bf16.total
    assert fp8_params.fp8_weights == 0 and fp8_params.params < bf16.params
    # fused_rowwise keeps each live block's weight cast for backward; torchao's rowwise does not count it
    fused, ao = _est("model=gpt", "fp8.recipe=fused_rowwise"), _est("model=gpt", "fp8.recipe=torchao_rowwise")
    assert fused.fp8_weights > 0 and ao.fp8_weights == 0 and fused.total > ao.total
    # fp8.cache_weight_casts: two bytes for each weight of every Linear (the 8b: ~7.5e9 of them),
    # which backward reads in place of the live blocks' casts
    cached = _est("model=gpt", "engine=fsdp2", "fp8.recipe=fused_rowwise", "fp8.cache_weight_casts=true",
                  "train.grad_accum_steps=2")
    plain = _est("model=gpt", "engine=fsdp2", "fp8.recipe=fused_rowwise", "train.grad_accum_steps=2")
    assert 2 * 7.4e9 < cached.fp8_weights < 2 * 7.6e9 and plain.fp8_weights < cached.fp8_weights
    # model=hf (measured): every weight's cast without activation checkpointing, about one unit's with it
    llama = ("model.hf_config={model_type: llama, hidden_size: 256, intermediate_size: 512, num_hidden_layers: 8, "
             "num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 512}")
    hf = {}
    for ac in ("none", "full"):
        cfg, _ = prepare(["model=hf", llama, "fp8.recipe=fused_rowwise", f"model.activation_checkpointing={ac}",
                          "precision.compute_dtype=bf16", "launcher.nproc_per_node=2", "launcher.dry_run=true"],
                         check_hardware=False)
        hf[ac] = estimate(cfg, ParallelDims.from_config(cfg.mesh, 2)).fp8_weights
    assert 0 < hf["full"] < hf["none"] / 4, hf


def test_fsdp2_holds_one_weight_copy_and_no_grads_at_the_peak():
    mf, f2 = _est(), _est("engine=fsdp2")
    assert f2.params == 0 and f2.grads == 0 and mf.grads > 0
    assert _est("engine=fsdp2", "train.grad_accum_steps=2").grads > 0  # accumulated grads are alive


def _bench(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), *args], capture_output=True,
                          text=True, env=cli_env(), timeout=300)


def test_bench_dry_plans_every_memory_run_with_an_estimate():
    out = _bench("--group", "memory", "--group", "ac_peak", "--group", "cp32k", "--dry")
    assert out.returncode == 0, out.stderr[-2000:]
    names = [e["name"] for e in bench.MATRIX if e["group"] in ("memory", "ac_peak", "cp32k")]
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()}
    assert set(lines) == set(names)
    gib = {n: float(lines[n].split("~")[1].split("GiB")[0]) for n in names}
    # ac_peak's acceptance, as estimated: full <= 0.6x none at gpt 1.4b seq 4096 mbs 8
    assert gib["acpeak_gpt_1.4b_mbs8_full"] < 0.6 * gib["acpeak_gpt_1.4b_mbs8_none"]
    # cp32k's premise: cp=1 cannot fit an H200 (139.8 GiB), cp=2 can
    for model in ("gpt", "te_gpt"):
        assert gib[f"cp32k_{model}_3b_cp1"] > 145 and gib[f"cp32k_{model}_3b_cp2"] < 120


def test_bench_dry_shows_the_reference_points():
    out = _bench("--group", "memory_reference", "--dry")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("measured") == len(json.loads((ROOT / "bench" / "memory_reference.json")
                                                         .read_text())["points"])


def test_bounded_run_kills_the_whole_tree():
    child = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
             "time.sleep(120)'], start_new_session=True); print(p.pid, flush=True); time.sleep(120)")
    t0 = time.monotonic()
    res = bench.run_bounded([sys.executable, "-c", child], timeout=3)
    assert time.monotonic() - t0 < 30 and res.returncode != 0 and "timed out" in res.stderr
    pid = int(res.stdout.split()[0])
    time.sleep(0.5)
    assert _gone(pid), f"grandchild {pid} survived"


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # killed, not yet reaped by init
    except FileNotFoundError:
        return True
