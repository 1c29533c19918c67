"""`train.compile`: each transformer block is compiled in place (names and FSDP hooks unchanged),
and a compiled run trains to the eager run's losses."""

import pytest

from helpers import cli_ok, read_metrics

torch = pytest.importorskip("torch")


def test_blocks_are_compiled_in_place_and_blockless_models_whole():
    from mfsdp_launch.models.compile import compile_model
    from mfsdp_launch.models.llama.gpt_modules import GPT, Block
    from mfsdp_launch.models.llama.dims import GPTDims

    model = GPT(GPTDims(dim=32, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=64, vocab_size=64,
                        tie_embeddings=False, norm_eps=1e-5, rope_theta=1e4))
    names = [n for n, _ in model.named_parameters()]
    assert compile_model(model, [Block]) is model
    assert all("forward" in vars(block) for block in model.layers)  # replaced per instance
    assert [n for n, _ in model.named_parameters()] == names
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert isinstance(compile_model(mlp, [Block]), torch._dynamo.eval_frame.OptimizedModule)


@pytest.mark.slow
def test_compiled_run_has_the_eager_losses(tmp_path):
    base = ["+recipe=cpu_smoke", "data=synthetic", "train.steps=3", "train.log_interval=1", "train.progress=false",
            "checkpoint.save_final=false", "train.seq_len=32"]
    losses = {}
    for flag in ("false", "true"):
        cli_ok(*base, f"train.compile={flag}", f"run.dir={tmp_path / flag}", timeout=400)
        losses[flag] = [r["loss"] for r in read_metrics(tmp_path / flag)]
    assert losses["true"] == pytest.approx(losses["false"], rel=1e-5)
