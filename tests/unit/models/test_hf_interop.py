"""gpt/te_gpt <-> Hugging Face Llama: export through `transformers`, load back, config checks, and
TE's interleaved fused-QKV layout as index math (TE cannot run on a CPU)."""

from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from mfsdp_launch.core.errors import ConfigError  # noqa: E402
from mfsdp_launch.models.llama import hf_config  # noqa: E402
from mfsdp_launch.models.llama import hf_keys as llama_keys
from mfsdp_launch.models import hf_weights as load  # noqa: E402
from mfsdp_launch.models.llama.hf_export import INDEX_FILE, SINGLE_FILE, export_gpt_state, plan_shards  # noqa: E402
from mfsdp_launch.models.llama.gpt_modules import GPT  # noqa: E402
from mfsdp_launch.models.llama.dims import GPTDims  # noqa: E402


def _dims(tie: bool = False, **kw) -> GPTDims:
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=256,
                tie_embeddings=tie, norm_eps=1e-5, rope_theta=10000.0)
    base.update(kw)
    return GPTDims(**base)


def _gpt(dims: GPTDims, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(dims).eval()


def _ids(vocab: int = 256):
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("tie,max_shard", [(False, None), (True, None), (False, 100_000)],
                         ids=["untied", "tied", "sharded"])
def test_export_loads_in_transformers_with_equal_logits(tmp_path, tie, max_shard):
    transformers = pytest.importorskip("transformers")
    dims = _dims(tie, rope_theta=500000.0, norm_eps=1e-6)
    ours = _gpt(dims)
    kw = {} if max_shard is None else {"max_shard_bytes": max_shard}
    info = export_gpt_state(ours.state_dict(), tmp_path, dims=dims, **kw)
    files = sorted(os.listdir(tmp_path))
    if max_shard:
        assert info["sharded"] and len(info["files"]) > 2
        index = json.loads((tmp_path / INDEX_FILE).read_text())
        assert set(index["weight_map"].values()) == set(info["files"])
        assert index["metadata"]["total_size"] == info["bytes"]
        assert SINGLE_FILE not in files
    else:
        assert files == ["config.json", SINGLE_FILE]
    for name in files:
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o644, name
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is tie
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                            attn_implementation="sdpa").eval()
    assert hf.config.num_key_value_heads == 2 and hf.config.rms_norm_eps == 1e-6
    with torch.no_grad():
        diff = (ours(_ids()) - hf(_ids()).logits).abs().max().item()
    assert diff <= 1e-4, diff


def test_reexport_replaces_an_earlier_sharded_export(tmp_path):
    dims = _dims()
    export_gpt_state(_gpt(dims).state_dict(), tmp_path, dims=dims, max_shard_bytes=100_000)
    assert (tmp_path / INDEX_FILE).exists()
    export_gpt_state(_gpt(dims).state_dict(), tmp_path, dims=dims, dtype=torch.bfloat16)
    assert sorted(os.listdir(tmp_path)) == ["config.json", SINGLE_FILE]
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_plan_shards_packs_in_order():
    assert plan_shards({"a": 4, "b": 4, "c": 9, "d": 1}, 8) == [["a", "b"], ["c"], ["d"]]
    assert plan_shards({"a": 4, "b": 4}, 100) == [["a", "b"]]


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_hf_dir_loads_into_a_fresh_gpt(tmp_path, tie):
    dims = _dims(tie)
    src = _gpt(dims, seed=0)
    export_gpt_state(src.state_dict(), tmp_path, dims=dims, max_shard_bytes=100_000)
    hf_dims = hf_config.read_llama_dims(tmp_path, key="model.init_from")
    assert hf_dims == dims
    dst = _gpt(dims, seed=1)
    with torch.no_grad():
        assert (src(_ids()) - dst(_ids())).abs().max().item() > 1e-2  # the load has work to do
    report = load.load_into_model(dst, tmp_path, sources=llama_keys.sources(dims, "gpt"))
    assert report.tensors == len(dst.state_dict()) and report.unused == []
    assert report.bytes_read == sum(p.numel() * 4 for p in dst.parameters())
    with torch.no_grad():
        assert torch.equal(src(_ids()), dst(_ids()))


def test_dims_mismatch_is_one_config_error_line(tmp_path):
    dims = _dims()
    export_gpt_state(_gpt(dims).state_dict(), tmp_path, dims=dims)
    hf_dims = hf_config.read_llama_dims(tmp_path, key="model.init_from")
    with pytest.raises(ConfigError) as err:
        hf_config.check_dims_match(_dims(n_kv_heads=4), hf_dims, source=str(tmp_path / "config.json"))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("model.n_kv_heads: 4 but ") and "num_key_value_heads=2" in msg
    # Loading into a model of other dims without the check is still one line, naming the tensor.
    with pytest.raises(ConfigError, match=r"^model.init_from: .*k_proj.weight has shape \[32, 64\]") as err:
        other = _dims(n_kv_heads=4)
        load.load_into_model(_gpt(other), tmp_path, sources=llama_keys.sources(other, "gpt"))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("change,needle", [
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope type 'llama3'"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "rope type 'yarn'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"head_dim": 32}, "head_dim=32"),
    ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, "is not a Llama layout"),
    ({"num_attention_heads": 3}, "not divisible"),
])
def test_unsupported_llama_configs_are_refused_in_one_line(change, needle):
    cfg = hf_config.llama_config(_dims())
    cfg.update(change)
    with pytest.raises(ConfigError) as err:
        hf_config.dims_from_llama_config(cfg, key="model.init_from")
    assert needle in str(err.value) and "\n" not in str(err.value)
    assert str(err.value).startswith("model.init_from: ")


def test_config_roundtrip_and_v5_rope_parameters():
    dims = _dims(True, rope_theta=500000.0, norm_eps=1e-6)
    cfg = hf_config.llama_config(dims, dtype="bf16")
    assert cfg["torch_dtype"] == cfg["dtype"] == "bfloat16"
    assert hf_config.dims_from_llama_config(cfg, key="k") == dims
    del cfg["rope_theta"]  # transformers 5 writes rope_parameters instead
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    assert hf_config.dims_from_llama_config(cfg, key="k") == dims


def test_missing_config_or_weights_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="has no config.json"):
        hf_config.read_llama_dims(tmp_path, key="model.init_from")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"has no model.safetensors .*only PyTorch .bin weights"):
        load.weight_files(tmp_path, key="model.init_from")


# ------------------------------------------------------------- TE's interleaved fused QKV layout


def _te_split(rows, n_heads: int, n_kv_heads: int, head_dim: int):
    """What TE's MultiheadAttention does to the fused QKV output (qkv_weight_interleaved=True):
    view [ng, np/ng + 2, hn], split the second-last dim (np/ng, 1, 1), reshape to heads."""
    per_group = n_heads // n_kv_heads
    x = rows.view(n_kv_heads, per_group + 2, head_dim)
    q, k, v = torch.split(x, [per_group, 1, 1], dim=-2)
    return q.reshape(n_heads, head_dim), k.reshape(n_kv_heads, head_dim), v.reshape(n_kv_heads, head_dim)


@pytest.mark.parametrize("n_heads,n_kv_heads,head_dim", [(4, 2, 8), (8, 8, 4), (6, 1, 4), (16, 4, 2)])
def test_te_qkv_row_order_matches_te_split(n_heads, n_kv_heads, head_dim):
    order = llama_keys.te_qkv_row_order(n_heads, n_kv_heads, head_dim)
    q_rows, kv_rows = n_heads * head_dim, n_kv_heads * head_dim
    assert sorted(order) == list(range(q_rows + 2 * kv_rows))  # a permutation
    # TE row r holds gpt row order[r]; TE's split must then see HF's heads.
    q, k, v = _te_split(torch.tensor(order), n_heads, n_kv_heads, head_dim)
    for h in range(n_heads):
        assert q[h].tolist() == list(range(h * head_dim, (h + 1) * head_dim))
    for g in range(n_kv_heads):
        assert k[g].tolist() == list(range(q_rows + g * head_dim, q_rows + (g + 1) * head_dim))
        assert v[g].tolist() == list(range(q_rows + kv_rows + g * head_dim, q_rows + kv_rows + (g + 1) * head_dim))


def test_te_state_is_gpt_state_with_permuted_qkv():
    dims = _dims()
    gpt_state = _gpt(dims).state_dict()
    hf = llama_keys.state_to_hf(gpt_state, dims, "gpt")
    te_state = llama_keys.hf_to_state(hf, dims, "te_gpt")
    order = torch.tensor(llama_keys.te_qkv_row_order(dims.n_heads, dims.n_kv_heads, dims.head_dim))
    names = zip(llama_keys.sources(dims, "gpt"), llama_keys.sources(dims, "te_gpt"))
    for ours, te in names:
        expected = gpt_state[ours][order] if ours.endswith("wqkv.weight") else gpt_state[ours]
        assert torch.equal(te_state[te], expected), te
    back = llama_keys.state_to_hf({**te_state, "layers.0.self_attention.core_attention._extra_state": None},
                                  dims, "te_gpt")
    assert all(torch.equal(back[k], hf[k]) for k in hf)
