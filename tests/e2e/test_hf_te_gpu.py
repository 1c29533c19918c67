"""te_gpt <-> Hugging Face Llama on a GPU with Transformer Engine (marker gpu; skipped without
CUDA or TE): the interleaved fused-QKV mapping checked against TE's real forward, both ways."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

DIMS = dict(dim=128, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=256, vocab_size=512,
            norm_eps=1e-5, rope_theta=10000.0)
TOLERANCE = 2e-3  # TE's fp32 kernels (unfused attention, its RMSNorm) differ from PyTorch's in rounding


def _te_or_skip():
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a half-installed TE raises RuntimeError/OSError
        pytest.skip(f"Transformer Engine is not usable: {type(exc).__name__}")
    pytest.importorskip("transformers")


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_te_gpt_exports_to_and_loads_from_transformers(tmp_path, tie):
    _te_or_skip()
    import torch
    import transformers

    from mfsdp_launch.models.llama import hf_keys as llama_keys
    from mfsdp_launch.models import hf_weights as load
    from mfsdp_launch.models.llama.hf_export import export_gpt_state
    from mfsdp_launch.models.llama.dims import GPTDims
    from mfsdp_launch.models.llama.te_modules import TEGPT

    torch.backends.cuda.matmul.allow_tf32 = False
    dims = GPTDims(tie_embeddings=tie, **DIMS)
    with torch.device("cuda"):
        torch.manual_seed(0)
        te_model = TEGPT(dims, params_dtype=torch.float32).eval()
    state = {k: v.cpu() for k, v in te_model.state_dict().items() if isinstance(v, torch.Tensor)}
    export_gpt_state(state, tmp_path, dims=dims, model="te_gpt")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                            attn_implementation="sdpa").cuda().eval()
    ids = torch.randint(0, dims.vocab_size, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.no_grad():
        te_logits = te_model(ids)
        export_diff = (te_logits - hf(ids).logits).abs().max().item()
    print(f"te_gpt -> HF max abs logit diff {export_diff:.2e}")
    assert export_diff <= TOLERANCE, export_diff

    with torch.device("cuda"):
        torch.manual_seed(1)
        fresh = TEGPT(dims, params_dtype=torch.float32).eval()
    report = load.load_into_model(fresh, tmp_path, sources=llama_keys.sources(dims, "te_gpt"))
    assert report.unused == []
    with torch.no_grad():
        assert torch.equal(fresh(ids), te_logits)  # same weights, same kernels: bit-identical


def test_te_gpt_cli_export_and_init_from_restart_at_the_same_loss(tmp_path):
    """Through the CLI on one GPU under Megatron-FSDP: a trained te_gpt exports with `--format hf`,
    transformers loads it with te_gpt's logits, and `model.init_from` restarts at the loss the
    exporting run had at that step (same weights, same batch)."""
    _te_or_skip()
    import torch
    import transformers

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from test_hf_e2e import export_hf, losses, train, window_batch

    from mfsdp_launch.checkpoint.weights import read_model_state
    from mfsdp_launch.models.llama.hf_config import read_llama_dims
    from mfsdp_launch.models.llama.te_modules import TEGPT

    window = tmp_path / "window.txt"
    window.write_bytes((b"The quick brown fox jumps over the lazy dog. " * 2)[:33])
    gpu = ["model=te_gpt", "engine=megatron_fsdp", "engine.backend=nccl", "launcher.nproc_per_node=1",
           f"data.path={window}", "model.n_kv_heads=2"]
    a, b = tmp_path / "A", tmp_path / "B"
    train(a, "train.steps=3", "checkpoint.interval=2", *gpu)
    hf_dir = export_hf(a / "checkpoints" / "step_2", tmp_path / "hf")

    torch.backends.cuda.matmul.allow_tf32 = False
    dims = read_llama_dims(hf_dir, key="model.init_from")  # the exported dims: tiny preset, 2 kv heads
    with torch.device("cuda"):
        ours = TEGPT(dims, params_dtype=torch.float32).eval()
    state = read_model_state(a / "checkpoints" / "step_2")[0]
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected and all(k.endswith("_extra_state") for k in missing), (missing, unexpected)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                               attn_implementation="sdpa").cuda().eval()
    ids = window_batch(window)["input_ids"].cuda()
    with torch.no_grad():
        diff = (ours(ids) - theirs(ids).logits).abs().max().item()
    print(f"te_gpt (CLI-trained) -> HF max abs logit diff {diff:.2e}")
    assert diff <= TOLERANCE, diff

    out = train(b, "train.steps=1", f"model.init_from={hf_dir}", *gpu)
    assert "model.init_from: loaded" in out.stdout, out.stdout
    print(f"losses: exporting run at step 3 {losses(a)[3]:.6f}, init_from at step 1 {losses(b)[1]:.6f}")
    assert losses(b)[1] == pytest.approx(losses(a)[3], rel=1e-5, abs=0)
