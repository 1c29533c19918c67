"""Real training through the CLI: torchrun, gloo, FSDP2, the loop, metrics.

Each run is a subprocess exactly as users start it; ports come from torchrun's --standalone
rendezvous, never fixed. The data-parallel layouts, ZeRO levels, accumulation, meta init, frozen
parameters and the toys train through the same loop in tests/unit/rank/test_data_parallel_layouts.py.
"""

import pytest

from helpers import cli_ok, read_metrics

pytestmark = pytest.mark.slow

# Small and quick: a tiny GPT on short synthetic sequences, fp32, logging every step.
BASE = ["engine=fsdp2", "model=gpt", "model.preset=tiny", "data=text", "data.max_bytes=2000000", "train.seq_len=32",
        "train.log_interval=1", "train.progress=false", "optim.warmup_steps=0", "optim.lr=1e-2",
        "checkpoint.save_final=false", "train.grad_clip=null"]


def loss_curve(run_dir):
    rows = read_metrics(run_dir)
    return [r["loss"] for r in rows], rows


def train(run_dir, *overrides, steps=4):
    return cli_ok(*BASE, f"run.dir={run_dir}", f"train.steps={steps}", *overrides, timeout=300)


def test_cpu_smoke_recipe_learns(tmp_path):
    """The README's main job: exit 0, loss falls, config.yaml and metrics.jsonl present."""
    run_dir = tmp_path / "smoke"
    cli_ok("+recipe=cpu_smoke", f"run.dir={run_dir}", "train.steps=30", "train.progress=false", timeout=300)
    assert (run_dir / "config.yaml").is_file()
    ls, rows = loss_curve(run_dir)
    assert ls[-1] < ls[0] - 0.5, ls
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu",
                "peak_mem_gib", "step_time_s"):
        assert key in rows[-1]
    assert rows[-1]["mfu"] is None  # a CPU has no known peak: null, never a guess
    assert rows[-1]["step"] == 30


def test_under_an_existing_torchrun_it_acts_as_a_worker(tmp_path):
    """`torchrun ... -m mfsdp_launch OVERRIDES`: no second launch; rank 0 freezes the config."""
    run_dir = tmp_path / "ext"
    out = cli_ok("--standalone", "--nproc-per-node=2", "-m", "mfsdp_launch", *BASE, f"run.dir={run_dir}",
                 "train.steps=3", module="torch.distributed.run", env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert "ranks, run.dir=" not in out.stdout  # the launcher did not start another torchrun
    assert "nproc_per_node: 2" in (run_dir / "config.yaml").read_text()  # taken from torchrun
    assert [r["step"] for r in loss_curve(run_dir)[1]] == [1, 2, 3]


def test_bf16_optimizer_state_trains_like_fp32(tmp_path):
    """optim.state_dtype=bf16 through the CLI (2 gloo ranks): the fp32 moments' loss curve, to ~1e-4."""
    train(tmp_path / "fp32", steps=12)
    train(tmp_path / "bf16", "optim.state_dtype=bf16", steps=12)
    (fp32, _), (bf16, _) = loss_curve(tmp_path / "fp32"), loss_curve(tmp_path / "bf16")
    assert bf16[-1] < bf16[0] - 0.5, bf16
    assert bf16[0] == fp32[0]  # the first loss is before any step
    assert max(abs(a - b) for a, b in zip(fp32, bf16)) < 0.01, (fp32, bf16)  # measured: ~1e-4
    assert fp32 != bf16
