"""The mixture of experts on one GPU (models/llama/moe.py, engines/megatron_experts.py):

* the bf16 grouped GEMM (`torch._grouped_mm`) and the padded batched GEMM give the CPU loop's
  outputs and weight gradients;
* under engine=megatron_fsdp (dp_shard=1, mesh.ep=1) the experts are Megatron-FSDP's expert
  parameters (allreduce=False) on the expert mesh, the grouped GEMM runs, and a bf16 run trains;
  the same model trains under fsdp2; DCP saves the experts in their global shape;
* a Qwen3-30B-A3B-shaped slice (model.preset=qwen3-30b-a3b model.n_layers=2) trains through the
  CLI under megatron_fsdp in bf16;
* FP8 (fp8.recipe=torchao_rowwise; the MoE is the plain-torch `gpt`'s, so TE's recipes do not
  apply): the experts' FP8 grouped GEMM (models/llama/moe_fp8.py) is close to the loop, runs
  under megatron_fsdp with the experts on the expert mesh and trains, and the slice trains in
  FP8 through the CLI, its mfu_at_precision counting the experts' FP8 FLOPs.

Each engine case runs in its own process (`python tests/gpu/test_moe_gpu.py CASE OUT`, one rank,
a fresh NCCL world), through the launcher's own builders (rank/runtime.py).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

pytestmark = pytest.mark.gpu

MOE = ["model=gpt", "model.preset=tiny_moe", "model.dim=128", "model.n_heads=4", "model.moe.ffn_dim=128",
       "model.moe.experts=8", "model.moe.top_k=2", "model.moe.shared_experts=1", "data=synthetic", "train.seq_len=128",
       "train.micro_batch_size=4", "train.grad_accum_steps=1", "optim.lr=3e-3", "optim.warmup_steps=0",
       "precision.compute_dtype=bf16", "precision.main_params_dtype=fp32", "mesh.dp_shard=1",
       "launcher.nproc_per_node=1"]


def _require_gpu():
    from _harness import require_gpus

    require_gpus(1)


def test_grouped_gemm_equals_the_loop():
    _require_gpu()
    import torch

    from mfsdp_launch.models.llama import moe

    torch.manual_seed(0)
    E, dim, ffn = 8, 256, 128
    counts = torch.tensor([5, 0, 17, 3, 40, 1, 0, 9])
    x = torch.randn(int(counts.sum()), dim, device="cuda")
    w1 = (0.02 * torch.randn(E, 2 * ffn, dim, device="cuda")).requires_grad_()
    w2 = (0.02 * torch.randn(E, dim, ffn, device="cuda")).requires_grad_()

    def run(fn, dtype):
        a, b = w1.detach().to(dtype).requires_grad_(), w2.detach().to(dtype).requires_grad_()
        y = fn(x.to(dtype), counts.cuda(), a, b)
        y.float().square().sum().backward()
        return y.float(), a.grad.float(), b.grad.float()

    assert moe.grouped_mm_applies(x.bfloat16(), w1.bfloat16(), w2.bfloat16())
    ref = run(lambda *a: moe._loop(a[0], a[1].cpu(), a[2], a[3]), torch.float32)
    for got in (run(moe._grouped, torch.bfloat16), run(moe._padded_bmm, torch.float32)):
        for g, r in zip(got, ref):
            assert torch.allclose(g, r, rtol=3e-2, atol=3e-2 * r.abs().max().item()), (g - r).abs().max()


def test_fp8_grouped_gemm_is_close_to_the_loop():
    _require_gpu()
    pytest.importorskip("torchao.prototype.moe_training")
    import torch

    from mfsdp_launch.models.llama import moe, moe_fp8

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("torchao's FP8 grouped GEMM needs compute capability 9.0+")
    torch.manual_seed(0)
    E, dim, ffn = 8, 256, 128
    counts = torch.tensor([5, 0, 17, 3, 40, 1, 0, 9], device="cuda")
    x = torch.randn(int(counts.sum()), dim, device="cuda")
    w1 = 0.02 * torch.randn(E, 2 * ffn, dim, device="cuda")
    w2 = 0.02 * torch.randn(E, dim, ffn, device="cuda")

    def run(fn, dtype):
        a, b, xx = (t.detach().to(dtype).requires_grad_() for t in (w1, w2, x))
        y = fn(xx, counts, a, b)
        y.float().square().sum().backward()
        return [t.float() for t in (y, xx.grad, a.grad, b.grad)]

    ref = run(lambda *a: moe._loop(a[0], a[1].cpu(), a[2], a[3]), torch.float32)
    got = run(lambda *a: moe_fp8.run_fp8(*a, moe._swiglu), torch.bfloat16)
    for what, g, r in zip(("out", "grad x", "grad w_gate_up", "grad w_down"), got, ref):
        err = ((g - r).norm() / r.norm()).item()
        print(f"FP8 grouped GEMM {what}: relative error {err:.4f}")
        assert err < 0.1, (what, err)  # e4m3 with rowwise scales: a few per cent


def _case(case: str, out: str) -> None:
    """One rank: build the MoE through rank/runtime.py's builders and train a few steps.
    `case`: the engine, with "+fp8" for fp8.recipe=torchao_rowwise."""
    import torch.distributed.checkpoint as dcp
    from _harness import expert_groups, fit_one_batch

    from mfsdp_launch.models.llama import moe, moe_fp8
    from mfsdp_launch.components.metrics import host_values
    from mfsdp_launch.planner import prepare
    from mfsdp_launch.rank.runtime import build_training, init_runtime

    engine, _, fp8 = case.partition("+")
    extra = ["fp8.recipe=torchao_rowwise", "fp8.skip=[lm_head]"] if fp8 else []
    cfg, _ = prepare([*MOE, f"engine={engine}", *extra], check_hardware=False)
    rt = init_runtime(cfg.engine, cfg.mesh)
    tr = build_training(cfg, rt)
    grouped = {"calls": 0}
    owner, name = (moe_fp8, "run_fp8") if fp8 else (moe, "_grouped")
    real = getattr(owner, name)

    def counted(*args):
        grouped["calls"] += 1
        return real(*args)

    setattr(owner, name, counted)  # counts the grouped-GEMM calls; the kernel itself runs
    experts = [p for m in tr.model.modules() if getattr(m, "is_expert_module", False) for p in m.parameters()]
    groups, expert_group = expert_groups(tr.model)
    losses, row = fit_one_batch(tr, rt.device, each_step=lambda: host_values(tr.spec.after_step(tr.model, True)))
    state = tr.engine.state_dict(tr.model, tr.optimizer)["model"]
    shapes = {k: list(v.shape) for k, v in state.items() if "experts" in k}
    dcp.save({"model": state}, checkpoint_id=os.path.join(out + ".ckpt"))
    Path(out).write_text(json.dumps({"losses": losses, "expert_groups": len(groups), "n_experts": len(experts),
                                     "expert_group": expert_group is not None, "grouped": grouped["calls"],
                                     "shapes": shapes, "load": row["moe_load_max"]}))


def _run_case(case: str, tmp_path) -> dict:
    from _harness import one_rank_script

    return one_rank_script(__file__, case, tmp_path)


@pytest.mark.parametrize("engine", ["megatron_fsdp", "fsdp2", "megatron_fsdp+fp8", "fsdp2+fp8"])
def test_moe_trains_on_one_gpu(engine, tmp_path):
    _require_gpu()
    if engine.endswith("+fp8"):
        import torch

        pytest.importorskip("torchao.prototype.moe_training")
        if torch.cuda.get_device_capability() < (9, 0):
            pytest.skip("torchao's FP8 grouped GEMM needs compute capability 9.0+")
    got = _run_case(engine, tmp_path)
    assert got["losses"][-1] < got["losses"][0] - 0.5, got["losses"]
    assert got["grouped"] > 0  # on CUDA: the grouped GEMM (bf16, or FP8 with +fp8), not a loop
    # DCP sees every expert: [experts, 2 * ffn, dim]
    assert [s for k, s in got["shapes"].items() if k.endswith("layers.0.mlp.experts.w_gate_up")] == [[8, 256, 128]]
    assert len(got["load"]) == 2 and got["n_experts"] == 4
    if engine.startswith("megatron_fsdp"):  # the experts are Megatron-FSDP's expert parameters, on the expert mesh
        assert got["expert_groups"] > 0 and got["expert_group"]


@pytest.mark.parametrize("fp8", ["none", "torchao_rowwise"])
def test_qwen3_slice_trains_under_megatron_fsdp(fp8, tmp_path):
    _require_gpu()
    from helpers import cli, read_metrics

    extra = [] if fp8 == "none" else [f"fp8.recipe={fp8}", "fp8.skip=[lm_head]"]
    out = cli("model=gpt", "model.preset=qwen3-30b-a3b", "model.n_layers=2", "engine=megatron_fsdp",
              "precision.compute_dtype=bf16", "precision.main_params_dtype=fp32", "data=synthetic",
              "train.seq_len=2048", "train.micro_batch_size=2", "train.steps=6", "train.log_interval=1",
              "train.progress=false", "checkpoint.save_final=false", f"run.dir={tmp_path / 'run'}", *extra,
              timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(rows) == 6 and all(r["mfu"] is None or 0 < r["mfu"] < 1 for r in rows)
    assert len(rows[-1]["moe_load_max"]) == 2
    assert all(r["loss"] == r["loss"] for r in rows) and rows[-1]["loss"] < rows[0]["loss"]
    if fp8 != "none":  # FP8 FLOPs count against the FP8 peak (twice bf16's); which: a CPU test
        assert rows[-1]["mfu_at_precision"] < 0.95 * rows[-1]["mfu"], rows[-1]


if __name__ == "__main__":
    _case(sys.argv[1], sys.argv[2])
