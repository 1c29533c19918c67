"""`model=hf`: HF causal LMs built from a config dict or a local directory, trained on CPU, loaded
from their own safetensors; refusals are one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import ROOT, model_cfg  # noqa: E402
from mfsdp_launch.core.errors import ConfigError  # noqa: E402
from mfsdp_launch.models.hf import model as hf_model
from mfsdp_launch.models import hf_weights as load  # noqa: E402
from mfsdp_launch.models.losses import cross_entropy_loss  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
CONFIGS = {
    "llama": dict(model_type="llama", **TINY),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True, **TINY),
}


def _batch(vocab: int = 256, seed: int = 0) -> dict:
    ids = torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_hf_config_model_trains_three_sgd_steps(family):
    src = hf_model.resolve_hf_model(hf_config=CONFIGS[family])
    assert src.class_name == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[family]
    torch.manual_seed(0)
    model = hf_model.build_hf_model(src)
    assert model.config._attn_implementation == "sdpa" and model.config.use_cache is False
    assert [c.__name__ for c in hf_model.unit_module_classes(model)] == [f"{family.capitalize()}DecoderLayer"]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batch, losses = _batch(), []
    for _ in range(3):
        loss = cross_entropy_loss(model, batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > losses[1] > losses[2], losses


def test_hf_class_with_config_dict_and_meta_init_matches_a_real_build():
    fields = {k: v for k, v in CONFIGS["llama"].items() if k != "model_type"}
    src = hf_model.resolve_hf_model(hf_config=fields, hf_class="LlamaForCausalLM")
    real = hf_model.build_hf_model(src)
    with torch.device("meta"):
        meta = hf_model.build_hf_model(src)
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    hf_model.init_hf_weights(meta)
    rope = meta.model.rotary_emb
    assert torch.equal(rope.inv_freq, real.model.rotary_emb.inv_freq)
    assert torch.equal(meta.model.norm.weight, torch.ones(64))
    assert abs(meta.lm_head.weight.std().item() - 0.02) < 0.002
    assert torch.isfinite(hf_model.hf_logits(meta, _batch()["input_ids"])).all()


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_local_dir_builds_and_pretrained_weights_load(tmp_path, family):
    src_cfg = hf_model.resolve_hf_model(hf_config=CONFIGS[family])
    torch.manual_seed(1)
    source = hf_model.build_hf_model(src_cfg).eval()
    source.save_pretrained(tmp_path)
    src = hf_model.resolve_hf_model(path=str(tmp_path))
    assert src.path == tmp_path and src.class_name == type(source).__name__
    with torch.device("meta"):
        model = hf_model.build_hf_model(src)
    model.to_empty(device="cpu")
    hf_model.init_hf_weights(model)
    report = load.load_into_model(model, tmp_path, key="model.path")
    assert report.unused == []
    model.eval()
    ids = _batch()["input_ids"]
    with torch.no_grad():
        assert torch.equal(hf_model.hf_logits(model, ids), hf_model.hf_logits(source, ids))
    if family == "qwen2":  # tied: the file has no lm_head.weight; the embedding fills both
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def _one_line(exc_info, key: str) -> str:
    msg = str(exc_info.value)
    assert "\n" not in msg and msg.startswith(f"{key}: "), msg
    return msg


def test_non_causal_architectures_are_refused(tmp_path):
    bert = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=256)
    with pytest.raises(ConfigError) as err:
        hf_model.resolve_hf_model(hf_config={"model_type": "bert", **bert})
    assert "is not a causal language model" in _one_line(err, "model.hf_config")
    with pytest.raises(ConfigError) as err:
        hf_model.resolve_hf_model(hf_config=bert, hf_class="BertForMaskedLM")
    assert "BertForMaskedLM" in _one_line(err, "model.hf_class")
    cfg = transformers.BertConfig(**bert)
    cfg.architectures = ["BertForMaskedLM"]
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ConfigError) as err:
        hf_model.resolve_hf_model(path=str(tmp_path))
    assert "is not a causal language model" in _one_line(err, "model.path")
    t5 = dict(d_model=64, num_layers=2, num_heads=4, d_ff=128, vocab_size=256)
    with pytest.raises(ConfigError) as err:
        hf_model.resolve_hf_model(hf_config={"model_type": "t5", **t5})
    _one_line(err, "model.hf_config")


def test_paths_that_are_not_local_hf_dirs_are_refused(tmp_path):
    with pytest.raises(ConfigError) as err:
        hf_model.resolve_hf_model(path="meta-llama/Llama-3.1-8B")
    assert "nothing is downloaded" in _one_line(err, "model.path")
    with pytest.raises(ConfigError) as err:
        hf_model.resolve_hf_model(path=str(tmp_path))
    assert "has no config.json" in _one_line(err, "model.path")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model_type"}))
    with pytest.raises(ConfigError) as err:
        hf_model.resolve_hf_model(path=str(tmp_path))
    _one_line(err, "model.path")
    with pytest.raises(ConfigError) as err:
        hf_model.resolve_hf_model()
    assert "exactly one of" in _one_line(err, "model.path")
    with pytest.raises(ConfigError) as err:
        hf_model.resolve_hf_model(hf_config=dict(TINY), hf_class="NoSuchForCausalLM")
    _one_line(err, "model.hf_class")


def test_without_transformers_model_hf_is_one_line_naming_the_extra():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "from mfsdp_launch.models.hf import model as hf_model\n"
            "try:\n    hf_model.resolve_hf_model(path='x')\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.stdout.strip() == ("ConfigError model.name: model=hf needs transformers, which is not installed "
                                  "(pip install 'mfsdp-launch[hf]')"), out.stdout + out.stderr


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_export_of_an_hf_model_reloads_with_equal_logits(tmp_path, family):
    from mfsdp_launch.models.llama.hf_export import export_hf_state

    torch.manual_seed(2)
    model = hf_model.build_hf_model(hf_model.resolve_hf_model(hf_config=CONFIGS[family])).eval()
    info = export_hf_state(model.state_dict(), tmp_path, hf_config=model.config.to_dict(), max_shard_bytes=200_000)
    assert info["sharded"]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert ("lm_head.weight" in index["weight_map"]) == (family == "llama")  # a tied head is not written
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = _batch()["input_ids"]
    with torch.no_grad():
        assert torch.equal(hf_model.hf_logits(back, ids), hf_model.hf_logits(model, ids))


def test_hf_class_must_fit_the_directory_config(tmp_path):
    transformers.LlamaConfig(**TINY).save_pretrained(tmp_path)
    assert hf_model.resolve_hf_model(path=str(tmp_path), hf_class="LlamaForCausalLM").class_name == "LlamaForCausalLM"
    with pytest.raises(ConfigError) as err:
        hf_model.resolve_hf_model(path=str(tmp_path), hf_class="Qwen2ForCausalLM")
    assert "Qwen2ForCausalLM takes a Qwen2Config, the config is a LlamaConfig" in _one_line(err, "model.hf_class")


def test_meta_build_initializes_module_by_module_as_megatron_fsdp_does():
    """Megatron-FSDP's meta init materializes each module that owns parameters and calls its
    reset_parameters(); buffers of parameter-less modules (RoPE) stay on meta. The family's build
    makes that give the model's own init and a working RoPE."""
    from mfsdp_launch.models import family

    cfg = model_cfg("hf", hf_config=dict(CONFIGS["llama"]), init_on_meta=True)
    spec = family("hf").spec(cfg, seq_len=16)
    with torch.device("meta"):
        model = spec.build()
    for m in model.modules():
        if any(True for _ in m.parameters(recurse=False)):
            m.to_empty(device="cpu", recurse=False)
            m.reset_parameters()
    assert model.model.rotary_emb.inv_freq.is_meta
    norms = [m.weight for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert norms and all(torch.equal(w, torch.ones_like(w)) for w in norms)
    assert abs(model.model.layers[0].mlp.up_proj.weight.std().item() - 0.02) < 0.003  # HF's init, not kaiming
    loss = spec.loss(model, _batch())
    assert not model.model.rotary_emb.inv_freq.is_meta
    reference = hf_model.build_hf_model(hf_model.resolve_hf_model(hf_config=CONFIGS["llama"]))
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.1
