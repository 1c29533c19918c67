"""Real training through the CLI: torchrun, gloo, FSDP2, the loop, metrics.

Each run is a subprocess exactly as users start it; ports come from torchrun's --standalone
rendezvous, never fixed.
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


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The curve every data-parallel layout below must reproduce: 1 rank, all 8 samples a step."""
    run_dir = tmp_path_factory.mktemp("reference") / "one"
    train(run_dir, "launcher.nproc_per_node=1", "train.micro_batch_size=8")
    one, _ = loss_curve(run_dir)
    assert len(one) == 4 and one[-1] < one[0]  # it learns: otherwise equality would prove little
    return one


def test_hsdp_on_4_ranks_matches_1_rank(tmp_path, reference):
    """dp_outer=2 x dp_shard=2 with 2 samples per rank == 1 rank with all 8 samples."""
    train(tmp_path / "hsdp", "launcher.nproc_per_node=4", "mesh.dp_outer=2", "mesh.dp_shard=2",
          "train.micro_batch_size=2")
    assert loss_curve(tmp_path / "hsdp")[0] == pytest.approx(reference, rel=1e-4, abs=1e-5)


def test_accumulation_with_last_microbatch_sync_equals_one_large_batch(tmp_path, reference):
    for name, sync in (("accum", []), ("every", ["engine.sync_every_microbatch=true"])):
        train(tmp_path / name, "launcher.nproc_per_node=2", "train.micro_batch_size=2", "train.grad_accum_steps=2",
              *sync)
        assert loss_curve(tmp_path / name)[0] == pytest.approx(reference, rel=1e-4, abs=1e-5), name


def test_zero2_and_no_shard_match_zero3(tmp_path, reference):
    """ZeRO-2 and no sharding on 2 ranks x 4 samples give the curve of the same global batch (ZeRO-3,
    the default, is the 2-rank accumulation run above and every other multi-rank run)."""
    for zero in ("optim_grads", "no_shard"):
        train(tmp_path / zero, "launcher.nproc_per_node=2", "train.micro_batch_size=4",
              f"sharding.zero_dp_strategy={zero}")
        assert loss_curve(tmp_path / zero)[0] == pytest.approx(reference, rel=1e-4, abs=1e-5), zero


def test_meta_init_trains(tmp_path):
    train(tmp_path / "meta", "launcher.nproc_per_node=2", "train.micro_batch_size=4", "model.init_on_meta=true",
          steps=6)
    ls, _ = loss_curve(tmp_path / "meta")
    assert ls[-1] < ls[0]


def test_toy_models_train_like_the_seed(tmp_path):
    for model in ("toy_cnn", "toy_transformer"):
        cli_ok("engine=fsdp2", f"model={model}", "data=synthetic", "launcher.nproc_per_node=2",
               f"run.dir={tmp_path / model}", "train.steps=8", "train.log_interval=1", "optim.lr=1e-2",
               "optim.warmup_steps=0", "optim.weight_decay=0", "checkpoint.save_final=false", timeout=300)
        ls, _ = loss_curve(tmp_path / model)
        assert ls[-1] < ls[0], (model, ls)


def test_frozen_parameters_do_not_move(tmp_path):
    """Frozen embeddings equal their seeded init after training; the rest moved."""
    import torch

    from mfsdp_launch.planner.compose import load_frozen
    from mfsdp_launch.models import build_model_spec

    run_dir = tmp_path / "frozen"
    out = train(run_dir, "launcher.nproc_per_node=2", "train.micro_batch_size=4", "model.freeze=[tok_emb.*]",
                "checkpoint.save_final=true")
    assert "frozen" in out.stdout
    from mfsdp_launch.tools.export import export

    export(run_dir, tmp_path / "w.pt", fmt="torch")
    trained = torch.load(tmp_path / "w.pt")
    cfg = load_frozen(run_dir / "config.yaml")
    torch.manual_seed(cfg.train.seed)  # the worker seeds like this before building
    initial = build_model_spec(cfg.model, cfg.train.seq_len).build().state_dict()
    assert torch.equal(trained["tok_emb.weight"], initial["tok_emb.weight"])
    moved = [k for k in initial if not k.startswith("tok_emb") and not torch.equal(trained[k], initial[k])]
    assert moved, "nothing trained"


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
