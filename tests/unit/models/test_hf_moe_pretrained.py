"""`model=hf model.pretrained=true` for Hugging Face MoE directories: transformers 5 builds fused
experts weights (gate_up_proj [E, 2f, dim], down_proj [E, dim, f]) but save_pretrained writes one
2-D tensor per expert and projection (Mixtral also under its old block name), as Hub checkpoints
are. The launcher's check and the loader read those (models/hf/moe.py: legacy_expert_sources).
Also: the routers' balancing loss is transformers' own (models/hf/router_loss.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import run_ranks  # noqa: E402
from mfsdp_launch.core.errors import ConfigError  # noqa: E402
from mfsdp_launch.models.hf.family import _check_weights  # noqa: E402
from mfsdp_launch.models.hf.moe import legacy_expert_sources  # noqa: E402
from mfsdp_launch.models.hf_weights import file_shapes, load_into_model, weight_files  # noqa: E402

COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
              max_position_embeddings=64, tie_word_embeddings=False)
CLASSES = {
    # MoE in layer 1 only: layer 0 keeps a dense MLP (its names are HF's own in the files too)
    "Qwen3MoeForCausalLM": dict(COMMON, head_dim=8, intermediate_size=64, moe_intermediate_size=24, num_experts=4,
                                num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[]),
    "MixtralForCausalLM": dict(COMMON, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2),
}


def _saved(tmp_path: Path, cls: str, seed: int = 0):
    torch.manual_seed(seed)
    model = getattr(transformers, cls)(getattr(transformers, cls).config_class(**CLASSES[cls], architectures=[cls]))
    model.save_pretrained(tmp_path / cls)
    return model, tmp_path / cls


def _renamed(cls: str, hf_dir: Path) -> dict:
    return legacy_expert_sources(cls, file_shapes(weight_files(hf_dir, key="model.pretrained")))


@pytest.mark.parametrize("cls", list(CLASSES))
def test_per_expert_files_fill_the_fused_weights(tmp_path, cls):
    saved, hf_dir = _saved(tmp_path, cls)
    keys = file_shapes(weight_files(hf_dir, key="k"))
    assert any(".experts.3." in k for k in keys) and not any(k.endswith("gate_up_proj") for k in keys)
    fresh = _saved(tmp_path / "other", cls, seed=1)[0]
    report = load_into_model(fresh, hf_dir, key="model.pretrained", renamed=_renamed(cls, hf_dir))
    assert report.unused == []
    want = saved.state_dict()
    for name, t in fresh.state_dict().items():
        assert torch.equal(t, want[name]), name
    assert torch.equal(fresh(torch.arange(12)[None]).logits, saved(torch.arange(12)[None]).logits)


def test_the_launcher_check_reads_per_expert_files_and_names_a_missing_one(tmp_path):
    from safetensors.torch import load_file, save_file

    cls = "Qwen3MoeForCausalLM"
    saved, hf_dir = _saved(tmp_path, cls)
    _check_weights(saved, hf_dir, cls)
    path = hf_dir / "model.safetensors"
    tensors = load_file(path)
    gone = "model.layers.1.mlp.experts.3.up_proj.weight"
    del tensors[gone]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ConfigError) as err:
        _check_weights(saved, hf_dir, cls)
    assert str(err.value) == f"model.pretrained: {hf_dir} has no weights for model.layers.1.mlp.experts.gate_up_proj"
    tensors[gone] = torch.zeros(25, 32)  # one row too many
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ConfigError) as err:
        _check_weights(saved, hf_dir, cls)
    assert str(err.value) == (f"model.pretrained: {gone.replace('up_proj', 'gate_proj')} + {gone} hold 49 rows in "
                              f"{hf_dir}, model.layers.1.mlp.experts.gate_up_proj[3] needs 48")


def _ranks_load(rank, world, hf_dir, out):
    import torch.distributed as dist

    from mfsdp_launch.mesh import ParallelDims
    from mfsdp_launch.planner import prepare
    from mfsdp_launch.rank.runtime import Runtime, build_training

    torch.set_num_threads(1)
    cfg, _ = prepare(["model=hf", f"model.path={hf_dir}", "model.pretrained=true", "engine=fsdp2", "data=synthetic",
                      "precision.compute_dtype=fp32", "precision.main_params_dtype=fp32", "train.seq_len=16",
                      "train.micro_batch_size=2", f"launcher.nproc_per_node={world}", "mesh.ep=2",
                      f"run.dir={out}/run", "train.progress=false"], check_hardware=False)
    dims = ParallelDims.from_config(cfg.mesh, world)
    rt = Runtime(rank, rank, world, torch.device("cpu"), dist.group.WORLD, dims, dims.build("cpu"))
    tr = build_training(cfg, rt)
    experts = tr.model.model.layers[1].mlp.experts.gate_up_proj
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in tr.model.named_parameters()}
    if rank == 0:
        torch.save(full, f"{out}/loaded.pt")
    Path(out, f"rank{rank}.json").write_text(json.dumps({"local": list(experts.to_local().shape)}))


def test_two_ranks_at_ep2_each_read_their_experts(tmp_path):
    cls = "Qwen3MoeForCausalLM"
    saved, hf_dir = _saved(tmp_path, cls)
    run_ranks(_ranks_load, 2, str(hf_dir), str(tmp_path), timeout=300)
    assert [json.loads((tmp_path / f"rank{r}.json").read_text())["local"] for r in range(2)] == [[2, 48, 32]] * 2
    loaded, want = torch.load(tmp_path / "loaded.pt"), saved.state_dict()
    assert sorted(loaded) == sorted(n for n, _ in saved.named_parameters())
    for name, t in loaded.items():
        assert torch.equal(t, want[name]), name


@pytest.mark.parametrize("cls", list(CLASSES))
def test_the_balancing_loss_is_transformers_own(cls):
    """With `output_router_logits` the loss gains transformers' balancing loss's gradient (its
    value stays the cross-entropy), and the metric is that loss over top_k."""
    from mfsdp_launch.components.metrics import host_values
    from mfsdp_launch.models.hf.router_loss import after_step, attach, with_router_loss

    coef = 0.05
    torch.manual_seed(0)
    config = getattr(transformers, cls).config_class(**CLASSES[cls], output_router_logits=True,
                                                     router_aux_loss_coef=coef)
    model = attach(getattr(transformers, cls)(config)).train()
    ids = torch.randint(0, 96, (2, 16))
    out = {}

    def base(m, batch):
        out["hf"] = m(input_ids=batch["input_ids"])
        return out["hf"].logits.float().mean()

    loss = with_router_loss(base, coef)(model, {"input_ids": ids})
    assert loss.item() == pytest.approx(out["hf"].logits.float().mean().item(), abs=1e-7)  # value unchanged
    router = next(m for n, m in model.named_modules() if n.endswith(".gate"))
    ours = torch.autograd.grad(loss - out["hf"].logits.float().mean(), router.weight, retain_graph=True)[0]
    theirs = torch.autograd.grad(coef * out["hf"].aux_loss, router.weight)[0]
    assert ours.abs().max() > 0 and torch.allclose(ours, theirs, rtol=1e-5, atol=1e-8)
    metrics = host_values(after_step(model, True))
    assert metrics["moe_aux_loss"] == pytest.approx(out["hf"].aux_loss.item() / config.num_experts_per_tok, rel=1e-5)
    assert len(metrics["moe_load_max"]) == len(model.model.layers) - (cls.startswith("Qwen3"))
