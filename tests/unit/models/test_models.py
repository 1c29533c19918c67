"""Tests for mfsdp_launch.models: the registry's numbers, the GPT, the seed's toy models and the TE models.

CPU-only and fast; the TE tests are marked `gpu` and skip without CUDA or Transformer Engine.
"""

import math
import subprocess
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from helpers import ROOT, cli_env, model_cfg
from mfsdp_launch.core.errors import ConfigError
from mfsdp_launch.models import build_model_spec, family
from mfsdp_launch.models.llama import dims as L
from mfsdp_launch.models.family import Parallel, resolve_unit_modules
from mfsdp_launch.models.llama.gpt_modules import GPT, Block
from mfsdp_launch.core.schema import ModelConfig

# nn.Transformer warns about nested tensors on every construction; the seed's model is as it is.
pytestmark = pytest.mark.filterwarnings("ignore:enable_nested_tensor:UserWarning")

DIM_SIZE = 2
NUM_LAYERS = 2


# --- Reference: the seed test's classes, pasted verbatim -----------------------------------


class RefToyCNN(torch.nn.Module):
    """Toy CNN model for testing Megatron-FSDP sharding for high-rank Tensor parameters and inputs."""

    def __init__(
        self,
        channels: int = 3,
        height: int = 10,
        width: int = 10,
        kernel_size: int = 3,
        output_dim: int = 10,
        bias: bool = True,
        num_layers: int = 1,
    ):
        super().__init__()
        self.channels = channels
        self.height = height
        self.width = width
        self.kernel_size = kernel_size
        self.output_dim = output_dim
        self.bias = bias
        self.num_layers = num_layers
        self.cnn_layers = torch.nn.ModuleList(
            [
                torch.nn.Conv2d(channels, channels, kernel_size, padding="same", bias=bias)
                for _ in range(num_layers)
            ]
        )
        self.dense = torch.nn.Linear(channels, 1, bias)

    def forward(self, x: torch.Tensor):
        """Toy forward pass for the CNN, where input and output shapes match."""
        x = x.broadcast_to(1, self.channels, self.height, self.width)
        for layer in self.cnn_layers:
            x = layer(x)
        x = x.transpose(1, 2).transpose(2, 3)
        x = self.dense(x).reshape(1, self.height, self.width)
        return x


class RefToyTransformer(torch.nn.Module):
    """Toy Transformer model for testing Megatron-FSDP."""

    def __init__(self, model_dim, num_heads, num_layers, output_dim):
        super().__init__()
        self.transformer = torch.nn.Transformer(
            d_model=model_dim,
            nhead=num_heads,
            num_encoder_layers=num_layers,
            num_decoder_layers=num_layers,
        )
        self.fc_out = torch.nn.Linear(model_dim, output_dim)

    def forward(self, x, y):
        x = self.transformer(x, y)
        x = self.fc_out(x)
        return x


def ref_build(model_type):
    """The seed's build_toy_model, on CPU."""
    if model_type == "toy_cnn":
        return RefToyCNN(
            channels=3, height=DIM_SIZE, width=DIM_SIZE, kernel_size=3,
            output_dim=DIM_SIZE, bias=True, num_layers=NUM_LAYERS,
        )
    return RefToyTransformer(
        model_dim=DIM_SIZE, num_heads=2, num_layers=NUM_LAYERS, output_dim=DIM_SIZE
    )


# --- helpers --------------------------------------------------------------------------------


def gpt_cfg(**kw):
    kw.setdefault("preset", "tiny")
    return model_cfg("gpt", **kw)


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def token_batch(vocab, batch, seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


# The registry's numbers for a model config (each family answers for itself).
def param_count(cfg):
    return family(cfg.name).param_count(cfg)


def flops_per_token(cfg, seq_len):
    return family(cfg.name).flops_per_token(cfg, seq_len)


def largest_unit_params(cfg):
    return family(cfg.name).largest_unit_params(cfg)


def matmul_params(cfg):
    return L.matmul_params(L.resolve_gpt_dims(cfg))


def activation_bytes(cfg, mbs, seq_len, bytes_per_el):
    return family(cfg.name).activation_bytes(cfg, mbs, seq_len, bytes_per_el)


def nominal(preset):
    """'125m' -> 125e6, '1.4b' -> 1.4e9, 'small' -> 20e6."""
    if preset == "small":
        return 20e6
    scale = {"m": 1e6, "b": 1e9}[preset[-1]]
    return float(preset[:-1]) * scale


# --- the registry's numbers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", [p for p in L.GPT_PRESETS if "moe" not in L.GPT_PRESETS[p]])  # MoE: test_moe.py
def test_every_preset_resolves(preset):
    cfg = gpt_cfg(preset=preset)
    d = L.resolve_gpt_dims(cfg)
    assert d.dim % d.n_heads == 0 and d.n_heads % d.n_kv_heads == 0
    n = param_count(cfg)
    assert param_count(model_cfg("te_gpt", preset=preset)) == n
    assert flops_per_token(cfg, 2048) > 6 * n * 0.5
    assert activation_bytes(cfg, 2, 256, 2) > 0
    if preset != "tiny":
        assert abs(n / nominal(preset) - 1) < 0.10, f"{preset}: {n:,}"


def test_named_presets_match_the_brief():
    d = L.resolve_gpt_dims(gpt_cfg(preset="1.4b"))
    assert (d.dim, d.n_layers, d.n_heads, d.vocab_size, d.tie_embeddings) == (2048, 24, 16, 32000, False)
    d = L.resolve_gpt_dims(gpt_cfg(preset="2b"))
    assert (d.dim, d.n_layers, d.n_heads) == (4096, 8, 32)
    d = L.resolve_gpt_dims(gpt_cfg(preset="8b"))
    assert (d.dim, d.n_layers, d.n_heads, d.n_kv_heads, d.ffn_dim, d.vocab_size, d.tie_embeddings) == (
        4096, 32, 32, 8, 14336, 128256, False
    )
    assert param_count(gpt_cfg(preset="8b")) == 8_030_261_248  # Llama-3.1-8B
    d = L.resolve_gpt_dims(gpt_cfg(preset="1.2b"))
    assert (d.n_layers, d.n_heads, d.n_kv_heads, d.ffn_dim, d.tie_embeddings) == (16, 32, 8, 8192, True)
    assert param_count(gpt_cfg(preset="1.2b")) == 1_235_814_400  # Llama-3.2-1B


def test_overrides_and_ffn_rule():
    d = L.resolve_gpt_dims(gpt_cfg(preset="tiny", dim=128, n_heads=8, n_kv_heads=2, vocab_size=512))
    assert (d.dim, d.n_heads, d.n_kv_heads, d.vocab_size, d.head_dim) == (128, 8, 2, 512, 16)
    assert d.ffn_dim == 384  # int(8*128/3)=341 -> multiple of 64
    assert L.llama_ffn_dim(2048) == 5632  # 5461 -> multiple of 256
    assert L.llama_ffn_dim(4096) == 11008
    # A preset's explicit ffn_dim follows its own dim only.
    assert L.resolve_gpt_dims(gpt_cfg(preset="8b", n_layers=2)).ffn_dim == 14336
    assert L.resolve_gpt_dims(gpt_cfg(preset="8b", dim=2048, n_heads=16)).ffn_dim == 5632
    assert L.resolve_gpt_dims(gpt_cfg(preset="8b", ffn_dim=1000)).ffn_dim == 1000


def test_unknown_preset_and_bad_dims():
    with pytest.raises(ConfigError, match="^model.preset: unknown preset 'huge' \\(allowed: tiny|small|125m"):
        L.resolve_gpt_dims(gpt_cfg(preset="huge"))
    with pytest.raises(ConfigError, match="^model.dim: 100 is not divisible by n_heads=3"):
        L.resolve_gpt_dims(gpt_cfg(dim=100, n_heads=3))
    with pytest.raises(ConfigError, match="^model.n_kv_heads: 3 does not divide n_heads=4"):
        L.resolve_gpt_dims(gpt_cfg(n_heads=4, n_kv_heads=3))
    with pytest.raises(ConfigError, match="must be even for RoPE"):
        L.resolve_gpt_dims(gpt_cfg(dim=60, n_heads=4))
    with pytest.raises(ConfigError, match="^model: unknown model 'resnet'"):
        build_model_spec(ModelConfig(name="resnet"), 16)


def test_the_registry_counts_without_torch():
    code = (
        "import sys; from mfsdp_launch.models import family;"
        "from mfsdp_launch.models import section_of;"
        "family('gpt').param_count(section_of('gpt')(name='gpt', preset='8b'));"
        "family('toy_transformer').flops_per_token(section_of('toy_transformer')(name='toy_transformer'), 1);"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=cli_env())


def test_accepts_omegaconf_nodes():
    from omegaconf import OmegaConf

    node = OmegaConf.structured(model_cfg("gpt", preset="tiny", n_layers=3))
    assert param_count(node) == param_count(gpt_cfg(n_layers=3))
    assert build_model_spec(node, 8).num_params == param_count(node)


def test_flops_per_token_formula():
    cfg = gpt_cfg()
    d = L.resolve_gpt_dims(cfg)
    model = GPT(d)
    # N_matmul = every Linear weight plus the head; not the embedding lookup or the norms.
    n_matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_params(cfg) == n_matmul
    assert flops_per_token(cfg, 128) == 6 * n_matmul + 12 * d.n_layers * d.dim * 128


@pytest.mark.parametrize(
    "cfg",
    [gpt_cfg(), gpt_cfg(tie_embeddings=True), gpt_cfg(dim=512, n_heads=8), model_cfg("toy_cnn"),
     model_cfg("toy_transformer"), model_cfg("toy_transformer", dim=16, output_dim=4000)],
    ids=lambda c: f"{c.name}-{c.dim}-{getattr(c, 'tie_embeddings', None)}",
)
def test_largest_unit_params(cfg):
    spec = build_model_spec(cfg, 8)
    with torch.device("meta"):
        model = spec.build()
    units = [m for m in model.modules() if isinstance(m, spec.unit_modules)]
    # Outermost units only; the root holds whatever no unit does.
    outer = [u for u in units if not any(u is not o and u in set(o.modules()) for o in units)]
    in_units = {id(p) for u in outer for p in u.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_units)
    expected = max([n_params(u) for u in outer] + [root])
    assert largest_unit_params(cfg) == expected


def test_activation_checkpointing_shrinks_activations():
    cfg = gpt_cfg(preset="1.4b")
    full = activation_bytes(cfg, 4, 2048, 2)
    ckpt = activation_bytes(gpt_cfg(preset="1.4b", activation_checkpointing="full"), 4, 2048, 2)
    assert 0 < ckpt < full / 3


# --- parameter counts against the real modules ---------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        dict(preset="tiny"),
        dict(preset="tiny", tie_embeddings=True),
        dict(preset="tiny", dim=128, n_heads=8, n_kv_heads=2),
        dict(preset="small"),
        dict(preset="8b", n_layers=2),
        dict(preset="3b", n_layers=1),
    ],
    ids=str,
)
def test_gpt_param_count_is_exact(overrides):
    cfg = gpt_cfg(**overrides)
    spec = build_model_spec(cfg, 32)
    with torch.device("meta"):
        model = spec.build()
    assert spec.num_params == n_params(model) == param_count(cfg)


@pytest.mark.parametrize(
    "name,overrides",
    [
        ("toy_cnn", {}),
        ("toy_cnn", dict(dim=5, n_layers=3)),
        ("toy_transformer", {}),
        ("toy_transformer", dict(dim=64, n_heads=4, n_layers=3, output_dim=7)),
        ("toy_transformer", dict(dim=1024, n_heads=16, n_layers=6)),
    ],
    ids=str,
)
def test_toy_param_count_is_exact(name, overrides):
    cfg = model_cfg(name, **overrides)
    spec = build_model_spec(cfg, 1)
    with torch.device("meta"):
        model = spec.build()
    assert spec.num_params == n_params(model) == param_count(cfg)


# --- toy models match the seed --------------------------------------------------------------


@pytest.mark.parametrize("name", ["toy_cnn", "toy_transformer"])
def test_toy_models_match_seed_exactly(name):
    spec = build_model_spec(model_cfg(name), 1)
    assert not spec.uses_tokens and spec.tokens_per_sample == 1 and family(name).tp_mode == Parallel.REPLICATE

    torch.manual_seed(0)
    ref = ref_build(name)
    torch.manual_seed(0)
    ours = spec.build()
    ref_sd, our_sd = ref.state_dict(), ours.state_dict()
    assert list(ref_sd) == list(our_sd)
    for key in ref_sd:
        assert torch.equal(ref_sd[key], our_sd[key]), key

    # The seed's inputs: torch.randn(1, DIM_SIZE, DIM_SIZE) for input, then target.
    torch.manual_seed(1)
    seed_x, seed_y = torch.randn(1, DIM_SIZE, DIM_SIZE), torch.randn(1, DIM_SIZE, DIM_SIZE)
    batch = spec.synthetic_batch(torch.Generator().manual_seed(1), 8, torch.device("cpu"))
    assert torch.equal(batch["x"], seed_x) and torch.equal(batch["y"], seed_y)

    ref.eval(), ours.eval()  # nn.Transformer has dropout
    with torch.no_grad():
        ref_out = ref(seed_x, seed_x) if name == "toy_transformer" else ref(seed_x)
        our_out = ours(seed_x, seed_x) if name == "toy_transformer" else ours(seed_x)
        assert ref_out.shape == our_out.shape == (1, DIM_SIZE, DIM_SIZE)
        assert torch.equal(ref_out, our_out)
        assert torch.equal(spec.loss(ours, batch), F.mse_loss(ref_out, seed_y))


def test_toy_unit_modules_and_reinit():
    cnn = build_model_spec(model_cfg("toy_cnn"), 1)
    assert cnn.unit_modules == (torch.nn.Conv2d, torch.nn.Linear)
    tr = build_model_spec(model_cfg("toy_transformer"), 1)
    assert tr.unit_modules == (torch.nn.Transformer,)
    for spec in (cnn, tr):
        with torch.device("meta"):
            model = spec.build()
        model.to_empty(device="cpu")
        torch.manual_seed(3)
        spec.init_weights(model)
        first = [p.clone() for p in model.parameters()]
        assert all(torch.isfinite(p).all() for p in first)
        torch.manual_seed(3)
        spec.init_weights(model)
        assert all(torch.equal(a, b) for a, b in zip(first, model.parameters()))
    # nn.Transformer's own xavier init runs after its layers' inits, as in its constructor.
    assert torch.equal(model.transformer.encoder.layers[0].norm1.weight, torch.ones(DIM_SIZE))


# --- GPT ------------------------------------------------------------------------------------


def test_gpt_loss_at_init_is_log_vocab():
    spec = build_model_spec(gpt_cfg(), 64)
    assert spec.uses_tokens and spec.tokens_per_sample == 64 and spec.unit_modules == (Block,)
    assert family("gpt").tp_mode == Parallel.DTENSOR and not family("gpt").has_te_layers
    torch.manual_seed(0)
    model = spec.build()
    loss = spec.loss(model, token_batch(256, 4, 64))
    assert abs(loss.item() - math.log(256)) < 0.1


def test_gpt_loss_falls_with_adamw():
    spec = build_model_spec(gpt_cfg(), 32)
    torch.manual_seed(0)
    model = spec.build()
    batch = token_batch(256, 4, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    losses = []
    for _ in range(30):
        loss = spec.loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_gpt_is_causal(kv_heads):
    torch.manual_seed(0)
    model = GPT(L.resolve_gpt_dims(gpt_cfg(n_kv_heads=kv_heads))).eval()
    ids = torch.randint(0, 256, (2, 24))
    changed = ids.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 256
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert a.shape == (2, 24, 256)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    assert (a[:, 10:] - b[:, 10:]).abs().amax() > 1e-4


def test_gpt_tied_head_shares_storage():
    spec = build_model_spec(gpt_cfg(tie_embeddings=True), 16)
    model = spec.build()
    assert model.lm_head is None
    assert model.head_weight is model.tok_emb.weight
    # Nothing can untie it: a single Parameter exists, also after meta init + to_empty.
    with torch.device("meta"):
        meta_model = spec.build()
    meta_model.to_empty(device="cpu")
    spec.init_weights(meta_model)
    assert meta_model.head_weight.data_ptr() == meta_model.tok_emb.weight.data_ptr()
    ids = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        h = meta_model.norm(meta_model.layers[1](meta_model.layers[0](meta_model.tok_emb(ids))))
        torch.testing.assert_close(meta_model(ids), h @ meta_model.tok_emb.weight.T)


def test_gpt_has_no_buffers_and_plain_state_dict():
    model = GPT(L.resolve_gpt_dims(gpt_cfg()))
    assert list(model.buffers()) == []
    assert set(model.state_dict()) == {name for name, _ in model.named_parameters()}


def test_gpt_init_weights_after_to_empty():
    cfg = gpt_cfg(preset="small", n_layers=2)
    spec = build_model_spec(cfg, 16)
    with torch.device("meta"):
        model = spec.build()
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(42)
    spec.init_weights(model)
    params = dict(model.named_parameters())
    assert all(torch.isfinite(p).all() for p in params.values())
    out_std = 0.02 / math.sqrt(2 * 2)
    for name, p in params.items():
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith(("wo.weight", "w_down.weight")):
            assert abs(p.std().item() - out_std) < 0.1 * out_std, name
        else:
            assert abs(p.std().item() - 0.02) < 0.002, name
            assert abs(p.mean().item()) < 0.002, name
    snapshot = {k: v.clone() for k, v in params.items()}
    torch.manual_seed(42)
    spec.init_weights(model)
    assert all(torch.equal(snapshot[k], v) for k, v in model.named_parameters())
    # The constructor's init follows the same scheme and the same order.
    torch.manual_seed(42)
    fresh = spec.build()
    assert all(torch.equal(snapshot[k], v) for k, v in fresh.named_parameters())


def test_gpt_params_dtype():
    spec = build_model_spec(gpt_cfg(params_dtype="bf16"), 16)
    model = spec.build()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    loss = spec.loss(model, token_batch(256, 2, 16))
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


# --- unit-module override -------------------------------------------------------------------


def test_unit_module_override():
    spec = build_model_spec(gpt_cfg(fsdp_unit_modules=["torch.nn.Linear"]), 16)
    assert spec.unit_modules == (torch.nn.Linear,)
    assert resolve_unit_modules(["mfsdp_launch.models.llama.gpt_modules.Block", "torch.nn.Transformer"]) == (
        Block, torch.nn.Transformer,
    )
    for bad in ["torch.nn.NoSuchLayer", "nosuchpackage.Layer", "torch.nn.functional.relu", "Linear"]:
        with pytest.raises(ValueError, match=bad.replace(".", r"\.")):
            build_model_spec(gpt_cfg(fsdp_unit_modules=["torch.nn.Linear", bad]), 16)


# --- Transformer Engine ---------------------------------------------------------------------


def _te_importable():
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - a half-installed TE raises RuntimeError/OSError
        return False
    return True


def test_te_models_import_lazily_and_fail_clearly():
    import mfsdp_launch.models.llama.te_modules  # noqa: F401 - import-safe without TE

    if _te_importable():
        pytest.skip("Transformer Engine is installed")
    with pytest.raises(RuntimeError, match="Transformer Engine is required for model=te_gpt") as err:
        build_model_spec(model_cfg("te_gpt"), 16)
    assert "\n" not in str(err.value)
    with pytest.raises(RuntimeError, match="model=te_toy_transformer"):
        build_model_spec(model_cfg("te_toy_transformer"), 16)
    # The dry-run numbers need no TE.
    assert param_count(model_cfg("te_toy_transformer")) == 2 * (6 * 64 * 64 + 10 * 64) + 64 * 64 + 64


def test_init_te_model_rules(monkeypatch):
    """The TE re-init's name rules, on a CPU stand-in with TE's parameter names."""
    from mfsdp_launch.models.llama import te_modules as te_models

    class FakeQuantized(torch.Tensor):
        pass

    monkeypatch.setattr(te_models, "te_module", lambda *a: types.SimpleNamespace(QuantizedTensor=FakeQuantized))

    def module(**params):
        m = torch.nn.Module()
        for name, shape in params.items():
            m.register_parameter(name, torch.nn.Parameter(torch.full(shape, 7.0)))
        return m

    attn = torch.nn.Module()
    attn.layernorm_qkv = module(layer_norm_weight=(64,), layer_norm_bias=(64,), weight=(192, 64), bias=(192,))
    attn.proj = module(weight=(64, 64), bias=(64,))
    layer = torch.nn.Module()
    layer.self_attention = attn
    layer.layernorm_mlp = module(layer_norm_weight=(64,), fc1_weight=(512, 64), fc2_weight=(64, 256))
    root = torch.nn.Module()
    root.layer = layer
    root.norm = module(weight=(64,))
    torch.manual_seed(0)
    te_models.init_te_model(root, std=0.02, out_std=0.002)
    p = dict(root.named_parameters())
    for name in ["layer.self_attention.layernorm_qkv.layer_norm_weight", "layer.layernorm_mlp.layer_norm_weight", "norm.weight"]:
        assert torch.equal(p[name], torch.ones_like(p[name])), name
    for name in ["layer.self_attention.layernorm_qkv.layer_norm_bias", "layer.self_attention.layernorm_qkv.bias", "layer.self_attention.proj.bias"]:
        assert torch.equal(p[name], torch.zeros_like(p[name])), name
    for name, std in [("layer.self_attention.layernorm_qkv.weight", 0.02), ("layer.layernorm_mlp.fc1_weight", 0.02),
                      ("layer.self_attention.proj.weight", 0.002), ("layer.layernorm_mlp.fc2_weight", 0.002)]:
        assert abs(p[name].std().item() - std) < 0.15 * std, name


def _require_cuda_and_te():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    try:
        return pytest.importorskip("transformer_engine.pytorch")
    except pytest.skip.Exception:
        raise
    except Exception as exc:  # noqa: BLE001 - half-installed TE
        pytest.skip(f"Transformer Engine is not usable: {exc}")


def _train(spec, model, batch, steps=10, lr=1e-3):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for _ in range(steps):
        loss = spec.loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.gpu
@pytest.mark.parametrize("tied", [False, True])
def test_te_gpt_trains_on_cuda(tied):
    te = _require_cuda_and_te()
    cfg = model_cfg("te_gpt", preset="tiny", tie_embeddings=tied, params_dtype="bf16")
    spec = build_model_spec(cfg, 64)
    assert family("te_gpt").has_te_layers and te.TransformerLayer in spec.unit_modules
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = spec.build()
    assert n_params(model) == spec.num_params
    batch = {k: v.cuda() for k, v in token_batch(256, 4, 64).items()}
    losses = _train(spec, model, batch, steps=30, lr=3e-3)
    assert abs(losses[0] - math.log(256)) < 0.2
    assert losses[-1] < 0.7 * losses[0], losses

    # Causal, and RoPE makes it position-aware.
    model.eval()
    ids = batch["input_ids"]
    changed = ids.clone()
    changed[:, 40] = (changed[:, 40] + 1) % 256
    with torch.no_grad():
        a, b = model(ids).float(), model(changed).float()
    assert (a[:, :40] - b[:, :40]).abs().amax() < 1e-2
    assert (a[:, 40:] - b[:, 40:]).abs().amax() > 1e-2


@pytest.mark.gpu
def test_te_gpt_meta_init():
    _require_cuda_and_te()
    spec = build_model_spec(model_cfg("te_gpt", preset="tiny", n_kv_heads=2), 32)
    with torch.device("meta"):
        model = spec.build()
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cuda")
    torch.manual_seed(0)
    spec.init_weights(model)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert abs(model.tok_emb.weight.std().item() - 0.02) < 0.003
    batch = {k: v.cuda() for k, v in token_batch(256, 2, 32).items()}
    loss = spec.loss(model, batch)
    loss.backward()
    assert abs(loss.item() - math.log(256)) < 0.2


@pytest.mark.gpu
def test_te_toy_transformer_trains_on_cuda():
    te = _require_cuda_and_te()
    # The seed's quantized test model: dim 64, 2 heads, 2 layers, fused QKV, bf16 params.
    cfg = model_cfg("te_toy_transformer", fuse_qkv=True, params_dtype="bf16")
    spec = build_model_spec(cfg, 1)
    assert spec.unit_modules == (te.TransformerLayer, te.Linear)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = spec.build()
    assert n_params(model) == spec.num_params
    batch = spec.synthetic_batch(torch.Generator().manual_seed(0), 16, torch.device("cuda"))
    assert batch["x"].shape == (16, 64, 64) and batch["x"].dtype == torch.bfloat16
    out = model(batch["x"])
    assert out.shape == (16, 64, 64)
    model.eval()  # the seed's layers keep TE's default dropout
    losses = _train(spec, model, batch, steps=20, lr=1e-2)
    assert losses[-1] < losses[0], losses
