"""MFU under FP8 (issue 27, goal 6): `mfu` stays against the dense bf16 peak, `mfu_at_precision` is
against the peak of the precision each GEMM ran in, FLOP-weighted. The FP8 share is hand-counted
here for te_gpt under a TE recipe, gpt under torchao float8 and a measured (custom) model; a bf16
run gets both figures equal. Pure functions, in process."""

from __future__ import annotations

import importlib
import types
from fractions import Fraction

import pytest
import torch

from helpers import model_cfg, write_user_module
from mfsdp_launch.core.fp8_flops import fp8_share
from mfsdp_launch.core.hardware import DENSE_PEAK_TFLOPS, peak_tflops_for
from mfsdp_launch.core.mfu import FP8_PER_BF16, dry_run_line, peaks_for, precision_peak, start_line
from mfsdp_launch.core.schema import FP8Config
from mfsdp_launch.models import family

SEQ = 128
# The tiny preset (dim 64, 2 layers, 4 heads, ffn 192, vocab 256), hand-counted per token:
# per layer qkv 64*192 + out 64*64 + MLP 3*64*192 = 53,248 weights, x2 layers = 106,496; head 64*256
# = 16,384; 6 x 122,880 = 737,280 matmul FLOPs + attention 12 * 2 layers * 64 * 128 = 196,608.
TOTAL = 737_280 + 196_608
LINEARS, HEAD, ATTENTION = 6 * 106_496, 6 * 16_384, 196_608


def fp8(recipe="none", **kw) -> FP8Config:
    return FP8Config(recipe=recipe, **kw)


def share(name: str, cfg: FP8Config, **dims) -> float:
    m = model_cfg(name, preset="tiny", **dims)
    return fp8_share(family(name).matmuls(m, SEQ), cfg)


def test_the_matmuls_add_up_to_the_flops_per_token():
    for name, keys in (("gpt", {}), ("te_gpt", {}), ("gpt", dict(tie_embeddings=True)), ("gpt", dict(preset="tiny_moe")),
                       ("gpt", dict(preset="deepseek-v2-lite", n_layers=2))):
        m = model_cfg(name, **{"preset": "tiny", **keys})
        fam = family(name)
        assert sum(mm.flops for mm in fam.matmuls(m, SEQ)) == pytest.approx(fam.flops_per_token(m, SEQ)), (name, keys)
    assert family("gpt").flops_per_token(model_cfg("gpt", preset="tiny"), SEQ) == TOTAL


def test_te_gpt_under_a_te_recipe_hand_counted():
    """TE linears and the te.Linear head in FP8, the attention core in bf16 unless fp8.attention."""
    assert share("te_gpt", fp8("delayed")) == pytest.approx((LINEARS + HEAD) / TOTAL)
    assert Fraction(LINEARS + HEAD, TOTAL) == Fraction(15, 19)
    assert share("te_gpt", fp8("current", attention=True)) == 1.0
    assert share("te_gpt", fp8("delayed", skip=["lm_head"])) == pytest.approx(LINEARS / TOTAL)
    # A whole layer kept out (a glob on the layer names all of its matmuls), and one part of a layer.
    per_layer = LINEARS // 2
    assert share("te_gpt", fp8("blockwise", skip=["layers.0"])) == pytest.approx((per_layer + HEAD) / TOTAL)
    mlp = 6 * 3 * 64 * 192
    assert share("te_gpt", fp8("mxfp8", skip=["layers.*.layernorm_mlp"])) == pytest.approx(
        (LINEARS + HEAD - 2 * mlp) / TOTAL)
    # A tied head is F.linear on the embedding: never in FP8.
    assert share("te_gpt", fp8("delayed"), tie_embeddings=True) == pytest.approx(LINEARS / TOTAL)
    # bf16: no FP8 GEMMs, whatever the model.
    assert share("te_gpt", fp8()) == 0.0 and share("gpt", fp8()) == 0.0


def test_gpt_under_torchao_float8_hand_counted():
    """torchao converts nn.Linear layers whose dimensions are multiples of 16, and a mixture of
    experts' grouped GEMMs under the same rule on (dim, ffn); SDPA, a head of an odd vocabulary and
    the MoE router stay in bf16; TE's FP8 attention is no part."""
    assert share("gpt", fp8("torchao_tensorwise")) == pytest.approx((LINEARS + HEAD) / TOTAL)
    assert share("gpt", fp8("torchao_rowwise", skip=["lm_head"])) == pytest.approx(LINEARS / TOTAL)
    odd = 6 * 64 * 250  # vocab 250: the head is not a multiple of 16
    assert share("gpt", fp8("torchao_rowwise"), vocab_size=250) == pytest.approx(LINEARS / (LINEARS + odd + ATTENTION))
    # tiny_moe: 4 experts of ffn 96, top_k 2: the attention linears and the experts' grouped GEMMs
    # (2 active experts x 3 matrices of 64 x 96 per token and layer).
    moe = model_cfg("gpt", preset="tiny_moe")
    attn, experts = 6 * 2 * (64 * 192 + 64 * 64), 6 * 2 * (2 * 3 * 64 * 96)
    got = fp8_share(family("gpt").matmuls(moe, SEQ), fp8("torchao_tensorwise"))
    assert got == pytest.approx((attn + experts + HEAD) / family("gpt").flops_per_token(moe, SEQ))
    skipped = fp8_share(family("gpt").matmuls(moe, SEQ), fp8("torchao_rowwise", skip=["layers.*.mlp.experts"]))
    assert skipped == pytest.approx((attn + HEAD) / family("gpt").flops_per_token(moe, SEQ))
    odd = model_cfg("gpt", preset="tiny_moe", moe={"ffn_dim": 40})  # not a multiple of 16: bf16 experts
    assert fp8_share(family("gpt").matmuls(odd, SEQ), fp8("torchao_rowwise")) == pytest.approx(
        (attn + HEAD) / family("gpt").flops_per_token(odd, SEQ))


def test_a_measured_model_counts_its_converted_linears(tmp_path, monkeypatch):
    """model=custom: the shares come from the built model's nn.Linear table (all matmul weights
    here, no attention), with fp8.skip applied to the module names."""
    write_user_module(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    from mfsdp_launch.models.lora import module_table

    m = model_cfg("custom", target="mfsdp_test_usermodel:build", fsdp_unit_modules=["mfsdp_test_usermodel.Block"])
    fam = family("custom")
    assert fam.matmuls(m, SEQ) is None and fp8_share(None, fp8("torchao_rowwise")) is None
    module = importlib.import_module("mfsdp_test_usermodel")
    linears = {n: io for n, io in module_table(module.build()).items() if io}
    mms = fam.matmuls(m, SEQ, linears=linears)
    assert sum(mm.flops for mm in mms) == pytest.approx(fam.flops_per_token(m, SEQ))
    assert fp8_share(mms, fp8("torchao_rowwise")) == pytest.approx(1.0)
    ff, head = 2 * 2 * 32 * 128, 32 * 256  # two blocks of dim 32 -> 128 -> 32, head 32 -> 256
    assert fp8_share(mms, fp8("torchao_rowwise", skip=["head"])) == pytest.approx(ff / (ff + head))


def test_peaks_per_precision():
    assert (peak_tflops_for("NVIDIA H200"), peak_tflops_for("NVIDIA H200", "fp8")) == (989.0, 1979.0)
    assert (peak_tflops_for("NVIDIA H100 80GB HBM3"), peak_tflops_for("NVIDIA H100 80GB HBM3", "fp8")) == (989.0, 1979.0)
    assert peak_tflops_for("NVIDIA GB200", "fp8") == 5000.0 and peak_tflops_for("NVIDIA B200", "fp8") == 4500.0
    assert peak_tflops_for("NVIDIA A100-SXM4-80GB", "fp8") is None and peak_tflops_for("a CPU") is None
    # The FP8 rule for a restated bf16 peak matches the table: every FP8 GPU there is ~2x its bf16.
    for name, bf16, f8 in DENSE_PEAK_TFLOPS:
        assert f8 is None or f8 / bf16 == pytest.approx(FP8_PER_BF16, rel=0.03), name
    h200 = peaks_for("NVIDIA H200", None)
    assert (h200.bf16, h200.fp8, h200.source) == (989.0, 1979.0, "NVIDIA H200 dense bf16")
    mine = peaks_for("NVIDIA H200", 800.0)  # train.peak_tflops restates bf16; FP8 keeps the device's ratio
    assert (mine.bf16, mine.source) == (800.0, "train.peak_tflops") and mine.fp8 == pytest.approx(800 * 1979 / 989)
    assert peaks_for("Some Future GPU", 500.0).fp8 == 1000.0 and peaks_for("NVIDIA A100", 300.0).fp8 is None
    assert peaks_for(None, None).bf16 is None and peaks_for("Some Future GPU", None).bf16 is None


def test_the_blended_peak_and_both_figures():
    h200 = peaks_for("NVIDIA H200", None)
    assert precision_peak(h200, 0.0) == 989.0 and precision_peak(h200, 1.0) == pytest.approx(1979.0)
    s = 15 / 19  # te_gpt tiny under FP8: every FLOP at its own precision's peak
    assert precision_peak(h200, s) == pytest.approx(1 / (s / 1979 + (1 - s) / 989))
    assert precision_peak(h200, None) is None and precision_peak(peaks_for("NVIDIA A100", None), 0.5) is None
    # The metrics row: mfu against 989 as before; mfu_at_precision against the blend (equal for bf16).
    from mfsdp_launch.rank.loop import TrainState, _log_row

    for share_, same in ((0.0, True), (s, False)):
        ctx = types.SimpleNamespace(world_size=1, spec=types.SimpleNamespace(flops_per_token=1e9),
                                    peak_tflops=h200.bf16, precision_peak_tflops=precision_peak(h200, share_),
                                    optimizer=types.SimpleNamespace(param_groups=[{"lr": 1e-3}]),
                                    device=torch.device("cpu"))
        row = _log_row(ctx, TrainState(step=1), 1.0, 1.0, 1e-3, 500, 0.0)  # 500k tokens/s x 1 GFLOP = 500 TFLOP/s
        assert row["mfu"] == pytest.approx(500 / 989)
        assert (row["mfu_at_precision"] == row["mfu"]) is same
        assert row["mfu_at_precision"] == pytest.approx(500 * (share_ / 1979 + (1 - share_) / 989))


def test_the_start_and_dry_run_lines_label_both_peaks():
    h200 = peaks_for("NVIDIA H200", None)
    assert start_line(peaks_for(None, None), 0.0) == "MFU null (a CPU has no known peak)"
    assert start_line(h200, 0.0) == ("MFU against 989 TFLOP/s (NVIDIA H200 dense bf16); "
                                     "mfu_at_precision the same (no FP8 GEMMs)")
    line = start_line(h200, 15 / 19)
    assert line.startswith("MFU against 989 TFLOP/s (NVIDIA H200 dense bf16); mfu_at_precision against 1")
    assert "78.9% of the FLOPs/token in FP8 GEMMs at 1979, the rest at 989" in line
    assert "null" in start_line(h200, None) and "no FP8 peak" in start_line(peaks_for("NVIDIA A100", None), 0.5)
    assert dry_run_line(None, 0.0) == ("MFU: mfu and mfu_at_precision against the GPU's dense bf16 peak "
                                       "(H200: 989 TFLOP/s); no FP8 GEMMs")
    two = dry_run_line(500.0, 1.0).splitlines()
    assert two == ["MFU: mfu against train.peak_tflops=500 TFLOP/s (bf16)",
                   "MFU: mfu_at_precision against the FP8-weighted peak: 100.0% of the FLOPs/token in FP8 GEMMs "
                   "(FP8 at 2x, blended 1000 TFLOP/s)"]
