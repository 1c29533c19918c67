"""scripts/trace_summary.py on a chrome trace written here in torch.profiler's export format
(GPU events are "ph": "X" with cat kernel / gpu_memcpy / gpu_memset, ts and dur in us), and
bench_peers' --profile plumbing that reads a launcher run's trace through it."""

import gzip
import json
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import bench_peers as bp  # noqa: E402
import trace_summary as ts  # noqa: E402


def kernel(name, ts_us, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts_us, "dur": dur, "pid": 0, "tid": 7}


EVENTS = [
    kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 0, 400),
    kernel("ncclDevKernel_AllGather_RING_LL", 100, 500),  # on another stream, overlapping the GEMM
    kernel("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", 900, 50),
    kernel("Memcpy DtoD (Device -> Device)", 1000, 50, cat="gpu_memcpy"),
    kernel("cutlass3x_sm90_grouped_gemm_GroupProblemShape_bf16", 1100, 300),
    kernel("void multi_tensor_apply_kernel<FusedAdamMathFunctor>", 1500, 100),
    kernel("triton_per_fused__to_copy_add_mean_mul_rsqrt_0", 1700, 100),
    kernel("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", 1900, 100),
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000, "pid": 1, "tid": 1},  # host side: not GPU time
]


def test_kinds_busy_time_and_per_step_figures(tmp_path):
    path = tmp_path / "rank0_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    s = ts.summarize(ts.gpu_kernels(ts.load_events(path)), steps=2)
    assert s["span_ms"] == pytest.approx(2.0 / 2)  # 0 .. 2000 us over 2 steps
    # the all-gather overlaps the GEMM: busy is the union (0-600, then 1,000 us of kernels after it)
    assert s["busy_ms"] == pytest.approx((600 + 50 + 50 + 300 + 100 + 100 + 100) / 2000)
    assert s["kernel_ms"] == pytest.approx(1600 / 2000)
    assert s["kinds"] == pytest.approx({"communication": 0.25, "GEMM": 0.2, "grouped GEMM": 0.15, "optimizer": 0.05,
                                         "compiled (triton)": 0.05, "attention": 0.05, "elementwise": 0.025,
                                         "copy / cast": 0.025})
    assert s["top"][0][0].startswith("ncclDevKernel") and s["top"][0][2] == 0.5  # launches per step
    text = ts.render(s, "demo")
    assert "GPU busy 0.65 ms (65.0 % of the span)" in text and "grouped GEMM" in text


def test_the_cli_refuses_a_missing_trace(tmp_path, capsys):
    assert ts.main([str(tmp_path / "none.json")]) == 2
    assert "no trace at" in capsys.readouterr().err


def test_a_profiled_launcher_entry_traces_one_step_and_its_table_is_written(tmp_path):
    e = bp.with_profile(dict(bp.ENTRIES["moe_compile"], world=1), 20)
    assert e["extra"][-1] == "train.profile={start: 20, steps: 1}" and "train.compile=true" in e["extra"]
    tt = bp.with_profile(dict(bp.ENTRIES["tt_moe_compile"], world=1), 20)
    assert tt["flags"][-3:] == ["--profiler.enable_profiling", "--profiler.profile_freq", "20"]
    assert bp.write_profile(e, tmp_path, 20) is None  # no trace: nothing written
    trace = tmp_path / e["name"] / "profile" / "trace_rank0.json"
    trace.parent.mkdir(parents=True)
    trace.write_text(json.dumps({"traceEvents": EVENTS}))
    out = bp.write_profile(e, tmp_path, 20)
    assert out and "grouped GEMM" in open(out).read()


def test_a_profiled_row_is_named_apart_from_the_unprofiled_one():
    import argparse

    plain, traced = (argparse.Namespace(rounds=1, tag="", profile=p) for p in (0, 20))
    assert bp.row_name("mfsdp_compile", 1, plain) == "peers_mfsdp_gpt_1.4b_bf16_mbs4_compile"
    assert bp.row_name("mfsdp_compile", 1, traced) == "peers_mfsdp_gpt_1.4b_bf16_mbs4_compile_prof"
    assert bp.row_name("mfsdp_compile", 2, argparse.Namespace(rounds=2, tag="_b", profile=20)) == \
        "peers_mfsdp_gpt_1.4b_bf16_mbs4_compile_round2_prof_b"
