"""Llama-3 RoPE scaling (`model.rope_scaling`, rope_type llama3) in gpt / te_gpt: the frequencies
equal transformers' in all three bands, a scaled HF Llama directory loads through model.init_from
with transformers' logits, an export keeps the scaling (4.x and 5.x config shapes both read back),
every malformed value is one line naming the key, and the KV-cache and fused decoders use it."""

from __future__ import annotations

import dataclasses
import json
import math
import textwrap
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from helpers import interpreted, refused, write_llama_dir  # noqa: E402
from test_hf_interop import _dims, _gpt  # noqa: E402

from mfsdp_launch.core.errors import ConfigError  # noqa: E402
from mfsdp_launch.models import FAMILIES, build_model_spec  # noqa: E402
from mfsdp_launch.models.llama import hf_config, hf_moe  # noqa: E402
from mfsdp_launch.models.llama.dims import RopeScaling, describe, resolve_gpt_dims  # noqa: E402
from mfsdp_launch.models.llama.gpt_modules import GPT, rope_angles, rope_cos_sin, rope_inv_freq  # noqa: E402
from mfsdp_launch.models.llama.hf_export import export_gpt_state  # noqa: E402
from mfsdp_launch.models.llama.kv_cache import KVCache, decode_step, prefill  # noqa: E402
from mfsdp_launch.planner import prepare  # noqa: E402
from mfsdp_launch.tools.generate import generate_gpt  # noqa: E402

# Llama-3.2's scaling with the old context cut to 64 tokens, so that positions up to a few hundred
# cover all three bands for head dims of 16 (theta 1e4) and 64 (theta 5e5).
SCALING = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
HF_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
OVERRIDE = ("model.rope_scaling={rope_type:llama3,factor:32.0,low_freq_factor:1.0,high_freq_factor:4.0,"
            "original_max_position_embeddings:64}")


def _bands(head_dim: int, theta: float, s: RopeScaling) -> tuple:
    """How many frequencies fall in the kept, blended and divided bands."""
    wavelen = 2 * math.pi / rope_inv_freq(head_dim, theta)
    old = s.original_max_position_embeddings
    high = int((wavelen < old / s.high_freq_factor).sum())
    low = int((wavelen > old / s.low_freq_factor).sum())
    return high, head_dim // 2 - high - low, low


def _ids(n: int, vocab: int = 256, batch: int = 2):
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(5))


# ------------------------------------------------------------------------------------ the math


@pytest.mark.parametrize("head_dim,theta", [(64, 500000.0), (16, 10000.0)])
def test_cos_sin_equal_transformers_llama_rotary_embedding_in_all_three_bands(head_dim, theta):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    high, medium, low = _bands(head_dim, theta, SCALING)
    assert high > 0 and medium > 0 and low > 0, (high, medium, low)
    config = transformers.LlamaConfig(hidden_size=4 * head_dim, num_attention_heads=4, max_position_embeddings=4096,
                                      rope_theta=theta, rope_scaling=dict(HF_SCALING))
    rotary = LlamaRotaryEmbedding(config)
    assert rotary.attention_scaling == 1.0  # llama3 scales no attention logits: cos/sin are comparable as they are
    positions = torch.arange(300)
    cos, sin = rotary(torch.zeros(1, 300, head_dim), positions[None])
    ours_cos, ours_sin = rope_cos_sin(300, head_dim, theta, "cpu", SCALING)
    torch.testing.assert_close(ours_cos, cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_sin, sin[0], rtol=0, atol=1e-6)
    # The bands as the rule says: the short wavelengths kept, the long ones divided by the factor.
    plain, scaled = rope_inv_freq(head_dim, theta), rope_inv_freq(head_dim, theta, SCALING)
    assert torch.equal(scaled[:high], plain[:high])
    torch.testing.assert_close(scaled[high + medium:], plain[high + medium:] / SCALING.factor, rtol=1e-6, atol=0)
    blended = scaled[high:high + medium]
    assert ((blended < plain[high:high + medium]) & (blended > plain[high:high + medium] / SCALING.factor)).all()


def test_te_gpt_scaled_table_is_the_gpt_angles_in_tes_layout():
    """te_gpt's table for a scaled RoPE (TE's RotaryPositionEmbedding has none); on the CPU here,
    against TE's own module in tests/gpu/test_rope_gpu.py."""
    from mfsdp_launch.models.llama.te_modules import ScaledRotaryEmbedding, rotary_embedding

    table = rotary_embedding(16, 1e4, SCALING, device="cpu")
    assert isinstance(table, ScaledRotaryEmbedding) and list(table.state_dict()) == []
    out = table(300)
    assert out.shape == (300, 1, 1, 16) and out.dtype == torch.float32
    assert torch.equal(out.view(300, 16), rope_angles(300, 16, 1e4, "cpu", SCALING))
    assert torch.equal(out.view(300, 16).cos(), rope_cos_sin(300, 16, 1e4, "cpu", SCALING)[0])
    assert torch.equal(table(10, offset=5).view(10, 16), out.view(300, 16)[5:15])


def test_scaling_keeps_the_shape_and_presets_and_shows_in_the_description():
    plain = resolve_gpt_dims(SimpleNamespace(preset="1.2b", norm_eps=1e-5, rope_theta=500000.0))  # no such key
    assert plain.rope_scaling is None
    scaled = resolve_gpt_dims(SimpleNamespace(preset="1.2b", norm_eps=1e-5, rope_theta=500000.0,
                                              rope_scaling=dict(HF_SCALING)))
    assert scaled.rope_scaling == SCALING and scaled.shape() == plain.shape()
    assert describe(scaled, "1.2b").endswith(" rope=llama3(factor=32, freq_factors=1-4, original_ctx=64)")
    assert "rope=" not in describe(plain, "1.2b")
    assert SCALING.to_config() == HF_SCALING


# ------------------------------------------------------------------------- HF in, HF out


@pytest.fixture(scope="module")
def scaled_llama(tmp_path_factory):
    """A tiny Llama-3.2-style directory saved by transformers (5.x writes rope_parameters)."""
    return write_llama_dir(tmp_path_factory.mktemp("llama3") / "llama", rope_theta=500000.0,
                           rope_scaling=dict(HF_SCALING), max_position_embeddings=512)


def test_init_from_a_scaled_llama_dir_gives_transformers_logits(scaled_llama):
    cfg, _ = prepare(["model=gpt", f"model.init_from={scaled_llama}", "launcher.dry_run=true"], check_hardware=False)
    assert dict(cfg.model.rope_scaling) == HF_SCALING  # taken from config.json, as rope_theta is
    spec = build_model_spec(cfg.model, 256)
    model = spec.build().eval()
    assert model.dims.rope_scaling == SCALING and model.dims.rope_theta == 500000.0
    FAMILIES["gpt"].load_weights(cfg.model, model, engine=None)
    hf = transformers.LlamaForCausalLM.from_pretrained(scaled_llama, dtype=torch.float32,
                                                       attn_implementation="sdpa").eval()
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    ids = _ids(200)  # past the old context of 64
    plain = GPT(dataclasses.replace(model.dims, rope_scaling=None)).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
        assert (plain(ids) - theirs).abs().max().item() > 1e-3  # the scaling matters for these logits
    diff = (ours - theirs).abs().max().item()
    assert diff <= 1e-5, diff


def test_a_set_rope_scaling_must_match_init_froms(scaled_llama, tmp_path):
    # Equal to config.json's: accepted, as an equal rope_theta is.
    prepare(["model=gpt", f"model.init_from={scaled_llama}", OVERRIDE], check_hardware=False)
    err = refused("model=gpt", f"model.init_from={scaled_llama}", OVERRIDE.replace("factor:32.0", "factor:8"))
    assert err.key == "model.rope_scaling" and "\n" not in str(err)
    assert str(err).startswith("model.rope_scaling: llama3(factor=8.0, ") and "has rope_scaling=llama3(factor=32.0" in \
        str(err), str(err)
    plain = write_llama_dir(tmp_path / "plain")
    err = refused("model=gpt", f"model.init_from={plain}", OVERRIDE)
    assert err.key == "model.rope_scaling" and str(err).endswith("config.json has rope_scaling=null"), str(err)


def test_export_keeps_the_scaling_and_transformers_loads_it(tmp_path):
    dims = _dims(rope_theta=500000.0, rope_scaling=SCALING)
    ours = _gpt(dims)
    export_gpt_state(ours.state_dict(), tmp_path / "out", dims=dims)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["rope_scaling"] == HF_SCALING and cfg["rope_theta"] == 500000.0
    assert cfg["max_position_embeddings"] > SCALING.original_max_position_embeddings  # transformers' rule
    assert hf_config.read_llama_dims(tmp_path / "out", key="model.init_from") == dims
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32,
                                                            attn_implementation="sdpa").eval()
    assert {k: hf.config.rope_parameters[k] for k in HF_SCALING} == HF_SCALING
    ids = _ids(150)
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-4, diff
    # Saved again by transformers 5 (rope_parameters, rope_theta inside): the same dims.
    hf.save_pretrained(tmp_path / "again")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert "rope_parameters" in again and "rope_scaling" not in again
    assert hf_config.read_llama_dims(tmp_path / "again", key="model.init_from") == dims
    # Unscaled dims write the config they always wrote.
    assert "rope_scaling" not in hf_config.llama_config(_dims())
    assert hf_config.llama_config(_dims())["max_position_embeddings"] == 4096


def test_export_writes_the_bases_max_positions(scaled_llama, tmp_path):
    # Llama-3.2's numbers: factor 32 over 8192, max_position_embeddings 131072 in Meta's config.json
    meta = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
    dims = _dims(rope_theta=500000.0, rope_scaling=meta)
    assert hf_config.max_positions(dims, 131072) == 131072  # the base's value, above the old context
    assert hf_config.max_positions(dims, 4096) == 262144  # not above it: the factor's reach
    assert hf_config.max_positions(_dims(), 4096) == 4096
    assert hf_config.base_max_positions(str(scaled_llama)) == 512
    assert hf_config.base_max_positions(str(tmp_path / "gone")) is None and hf_config.base_max_positions(None) is None


def test_variant_exports_write_the_scaling_too():
    dims = _dims(qk_norm=True, rope_scaling=SCALING)
    cfg = hf_moe.hf_config(dims)
    assert cfg["architectures"] == [hf_moe.QWEN3] and cfg["rope_scaling"] == HF_SCALING
    assert transformers.Qwen3Config(**cfg).rope_parameters["rope_type"] == "llama3"
    assert "rope_scaling" not in hf_moe.hf_config(_dims(qk_norm=True))


@pytest.mark.parametrize("rope", [
    {"rope_scaling": dict(HF_SCALING)},  # transformers 4.x / the hub's Llama-3.x config.json
    {"rope_scaling": {**{k: v for k, v in HF_SCALING.items() if k != "rope_type"}, "type": "llama3"}},  # older key
    {"rope_parameters": {**HF_SCALING, "rope_theta": 500000.0}},  # transformers 5.x
    # The old context missing: transformers takes max_position_embeddings.
    {"rope_scaling": {k: v for k, v in HF_SCALING.items() if k != "original_max_position_embeddings"},
     "max_position_embeddings": 64},
], ids=["v4", "v4-type", "v5", "no-original"])
def test_both_hf_config_shapes_read_back(rope):
    dims = _dims(rope_theta=500000.0)
    cfg = hf_config.llama_config(dims)
    if "rope_parameters" in rope:  # transformers 5 keeps rope_theta inside
        del cfg["rope_theta"]
    cfg.update(rope)
    assert hf_config.dims_from_llama_config(cfg, key="model.init_from") == _dims(rope_theta=500000.0,
                                                                                  rope_scaling=SCALING)


# ------------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("value,says", [
    ("{rope_type:yarn,factor:2.0}", "rope type 'yarn' is not supported by gpt/te_gpt (allowed: default, llama3)"),
    ("{factor:2.0}", "has no rope_type (allowed: default, llama3)"),
    ("{rope_type:llama3,factor:0,low_freq_factor:1,high_freq_factor:4,original_max_position_embeddings:64}",
     "factor must be > 0, got 0"),
    ("{rope_type:llama3,factor:-8,low_freq_factor:1,high_freq_factor:4,original_max_position_embeddings:64}",
     "factor must be > 0, got -8"),
    ("{rope_type:llama3,factor:8,low_freq_factor:4,high_freq_factor:4,original_max_position_embeddings:64}",
     "high_freq_factor=4 must exceed low_freq_factor=4"),
    ("{rope_type:llama3,factor:8,low_freq_factor:1,high_freq_factor:4}", "rope type 'llama3' needs "
                                                                        "original_max_position_embeddings"),
    ("{rope_type:llama3,factor:8,low_freq_factor:1,high_freq_factor:4,original_max_position_embeddings:64.5}",
     "original_max_position_embeddings must be a whole number"),
    ("{rope_type:llama3,factor:x,low_freq_factor:1,high_freq_factor:4,original_max_position_embeddings:64}",
     "factor must be a finite number, got 'x'"),
    ("{rope_type:llama3,factor:8,low_freq_factor:1,high_freq_factor:4,original_max_position_embeddings:64,beta:1}",
     "unknown key(s) beta for rope type 'llama3'"),
    ("8", "must be a mapping, got 8"),
])
@pytest.mark.parametrize("model", ["gpt", "te_gpt"])
def test_a_bad_rope_scaling_is_one_line_naming_the_key(model, value, says):
    err = refused(f"model={model}", f"model.rope_scaling={value}")
    assert err.key == "model.rope_scaling" and says in str(err) and "\n" not in str(err), str(err)
    assert err.allowed, str(err)  # says what is allowed


def test_a_bad_hf_rope_scaling_is_one_line_under_init_from():
    cfg = hf_config.llama_config(_dims())
    cfg["rope_scaling"] = {**HF_SCALING, "factor": 0}
    with pytest.raises(ConfigError) as err:
        hf_config.dims_from_llama_config(cfg, key="model.init_from")
    assert str(err.value).startswith("model.init_from: config.json: rope_scaling: factor must be > 0, got 0")
    cfg["rope_scaling"] = {"rope_type": "longrope", "factor": 2.0}
    with pytest.raises(ConfigError, match=r"^model.init_from: config.json: rope_scaling: rope type 'longrope' is not "
                                          r"supported by gpt/te_gpt \(allowed: default, llama3\)$"):
        hf_config.dims_from_llama_config(cfg, key="model.init_from")


# ------------------------------------------------------------------------------- generation


@pytest.fixture(scope="module")
def scaled_gpt():
    torch.manual_seed(0)
    model = GPT(_dims(rope_scaling=SCALING)).eval()
    with torch.no_grad():  # larger weights: greedy streams that depend on the positions
        for p in model.parameters():
            p.mul_(3)
    return model


def test_kv_cache_decoding_gives_the_full_forwards_logits_past_the_old_context(scaled_gpt):
    ids = _ids(120, batch=1)
    with torch.no_grad():
        full = scaled_gpt(ids)
        cache = KVCache.for_model(scaled_gpt, 1, 120)
        steps = [prefill(scaled_gpt, ids[:, :40], cache)]
        steps += [decode_step(scaled_gpt, ids[:, i:i + 1], torch.tensor(i), cache) for i in range(40, 120)]
    diff = (torch.cat(steps, dim=1) - full).abs().max().item()
    assert diff <= 1e-5, diff


def test_greedy_generation_follows_the_scaled_full_forward(scaled_gpt):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    with torch.inference_mode():
        got = generate_gpt(scaled_gpt, prompt, max_new_tokens=90, eos_id=None)
        ids = list(prompt)
        for _ in range(90):  # no cache: the whole sequence each time
            ids.append(int(scaled_gpt(torch.tensor([ids]))[0, -1].argmax()))
    assert got == ids[len(prompt):]


_FUSED = textwrap.dedent("""
    import json, torch
    from mfsdp_launch.models.llama.dims import GPTDims, RopeScaling
    from mfsdp_launch.models.llama.gpt_modules import GPT, rope_inv_freq
    from mfsdp_launch.models.llama.fused_decode import FusedDecoder
    from mfsdp_launch.models.llama.kv_cache import KVCache, decode_step, prefill

    scaling = RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64)
    dims = GPTDims(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=300,
                   tie_embeddings=False, norm_eps=1e-5, rope_theta=1e4, rope_scaling=scaling)
    torch.manual_seed(0)
    model = GPT(dims).eval()
    prompt = torch.tensor([[1, 5, 9, 200, 7, 3, 3, 90]])
    eager_cache, fused_cache = KVCache.for_model(model, 1, 100), KVCache.for_model(model, 1, 100)
    with torch.no_grad():
        prefill(model, prompt, eager_cache)
        prefill(model, prompt, fused_cache)
        fused = FusedDecoder(model, fused_cache)
        diffs = []
        for pos in (70, 99):  # past the old context of 64
            token = torch.tensor([[pos]])
            a = decode_step(model, token, torch.tensor(pos), eager_cache)
            b = fused(model, token, torch.tensor(pos), fused_cache)
            diffs.append([(a - b).abs().max().item(), a.abs().max().item()])
    same = torch.equal(fused.inv_freq, rope_inv_freq(64, 1e4, scaling))
    print(json.dumps({"diffs": diffs, "same_inv_freq": same}))
""")


def test_the_fused_decoder_uses_the_scaling():
    out = interpreted(_FUSED)
    assert out["same_inv_freq"]
    for logits, scale in out["diffs"]:
        assert logits <= 1e-5 * max(1.0, scale), out["diffs"]
