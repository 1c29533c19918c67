"""`train.compile`: each transformer block is compiled in place (names and FSDP hooks unchanged),
and a compiled run trains to the eager run's losses."""

import pytest

from helpers import read_metrics, train_ranks

torch = pytest.importorskip("torch")


def test_blocks_are_compiled_in_place_and_blockless_models_whole():
    from mfsdp_launch.models.compile import compile_model
    from mfsdp_launch.models.llama.gpt_modules import GPT, Block
    from mfsdp_launch.models.llama.dims import GPTDims

    model = GPT(GPTDims(dim=32, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                        tie_embeddings=False, norm_eps=1e-5, rope_theta=1e4))
    names = [n for n, _ in model.named_parameters()]
    compiled, line = compile_model(model, [Block])
    assert compiled is model and line.startswith("train.compile: on: 2 Block unit(s) compiled in place")
    assert all("forward" in vars(block) for block in model.layers)  # replaced per instance
    assert [n for n, _ in model.named_parameters()] == names
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4))
    compiled, line = compile_model(mlp, [Block])
    assert isinstance(compiled, torch._dynamo.eval_frame.OptimizedModule)
    assert line.startswith("train.compile: on: the whole Sequential as one region (no plain-torch units)")


@pytest.mark.slow
def test_compiled_run_has_the_eager_losses(tmp_path):
    # One rank: the FSDP2 hooks run around each compiled block on any world size (a 1-rank mesh
    # still swaps the unsharded parameters in), and every extra rank compiles the block again.
    base = ["+recipe=cpu_smoke", "data=synthetic", "train.steps=3", "train.log_interval=1", "train.progress=false",
            "checkpoint.save_final=false", "train.seq_len=32", "launcher.nproc_per_node=1",
            "train.grad_accum_steps=1"]
    losses = {}
    for flag in ("false", "true"):
        out = train_ranks(*base, f"train.compile={flag}", f"run.dir={tmp_path / flag}", timeout=400)
        # The run says that compile is on and what it compiled (the gpt's blocks), or nothing.
        assert ("train.compile: on: 2 Block unit(s) compiled in place" in out) == (flag == "true")
        losses[flag] = [r["loss"] for r in read_metrics(tmp_path / flag)]
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-5)


def test_train_compile_turns_on_the_compiled_cross_entropy_for_cuda_logits_only(monkeypatch):
    """The cross-entropy outside the units goes through torch.compile once compile_model ran, for
    CUDA logits; CPU logits keep the eager kernel (the same function, so the same figure)."""
    from mfsdp_launch.models import losses
    from mfsdp_launch.models.compile import compile_model

    monkeypatch.setitem(losses._COMPILED_CE, "on", False)
    monkeypatch.setitem(losses._COMPILED_CE, "fn", None)
    compile_model(torch.nn.Sequential(torch.nn.Linear(4, 4)), [])
    assert losses._COMPILED_CE["on"]
    logits, labels = torch.randn(2, 3, 11), torch.tensor([[1, 2, -100], [4, 5, 6]])
    assert torch.equal(losses.summed_cross_entropy(logits, labels), losses.plain_summed_cross_entropy(logits, labels))
    assert losses._COMPILED_CE["fn"] is None  # nothing compiled for the CPU
