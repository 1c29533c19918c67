"""Hugging Face mixtures of experts (`model=hf`, models/hf/expert_parallel.py) under
engine=megatron_fsdp on one GPU (dp_shard=1, mesh.ep=1): the experts blocks of a tiny Qwen3-MoE and
a tiny Mixtral are Megatron-FSDP's expert parameters (allreduce=False, in expert parameter groups,
with the expert data-parallel group; engines/megatron_experts.py), as the Llama family's
GroupedExperts are, and a bf16 run trains; DCP saves the experts under HF's names in their global
shape.

With `model.pretrained=true` on a directory as `save_pretrained` writes it (one tensor per expert,
models/hf/moe.py: legacy_expert_sources) the sharded experts hold the saved weights, and with the
config's `output_router_logits` the step trains with transformers' balancing loss and reports the
expert loads (models/hf/router_loss.py).

Each case runs in its own process (`python tests/gpu/test_hf_moe_gpu.py CLASS OUT`, one rank, a
fresh NCCL world), through the launcher's own builders (rank/runtime.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

pytestmark = pytest.mark.gpu

COMMON = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
              max_position_embeddings=256, tie_word_embeddings=False)
CLASSES = {"Qwen3MoeForCausalLM": dict(COMMON, head_dim=32, intermediate_size=256, moe_intermediate_size=128,
                                       num_experts=8, num_experts_per_tok=2),
           "MixtralForCausalLM": dict(COMMON, intermediate_size=128, num_local_experts=8, num_experts_per_tok=2)}
BASE = ["model=hf", "engine=megatron_fsdp", "data=synthetic", "train.seq_len=128", "train.micro_batch_size=4",
        "train.grad_accum_steps=1", "optim.lr=3e-3", "optim.warmup_steps=0", "precision.compute_dtype=bf16",
        "precision.main_params_dtype=fp32", "mesh.dp_shard=1", "launcher.nproc_per_node=1"]


def _overrides(cls: str) -> list:
    body = ", ".join(f"{k}: {json.dumps(v)}" for k, v in CLASSES[cls].items())
    return [*BASE, f"model.hf_class={cls}", f"model.hf_config={{{body}}}"]


def _case(cls: str, out: str) -> None:
    """One rank: build the HF MoE through rank/runtime.py's builders and train a few steps."""
    import torch.distributed.checkpoint as dcp
    from _harness import expert_groups, fit_one_batch

    from mfsdp_launch.planner import prepare
    from mfsdp_launch.rank.runtime import build_training, init_runtime

    cfg, _ = prepare(_overrides(cls), check_hardware=False)
    rt = init_runtime(cfg.engine, cfg.mesh)
    tr = build_training(cfg, rt)
    blocks = [m for m in tr.model.modules() if getattr(m, "is_expert_module", False)]
    experts = [p for m in blocks for p in m.parameters()]
    groups, expert_group = expert_groups(tr.model)
    losses, _ = fit_one_batch(tr, rt.device)
    state = tr.engine.state_dict(tr.model, tr.optimizer)["model"]
    shapes = {k: list(v.shape) for k, v in state.items() if ".experts." in k}
    dcp.save({"model": state}, checkpoint_id=out + ".ckpt")
    Path(out).write_text(json.dumps({
        "losses": losses, "blocks": len(blocks), "n_experts": len(experts), "expert_groups": len(groups),
        # Megatron-FSDP swaps in its own parameters (without the allreduce flag): count its groups' members
        "in_expert_groups": sum(len(g.params) for g in groups), "expert_group": expert_group is not None,
        "shapes": shapes}))


def _pretrained_case(cls: str, out: str) -> None:
    """One rank: save a tiny HF MoE as transformers does (per-expert tensors), load it with
    model.pretrained=true under megatron_fsdp, compare the experts, train with the router loss."""
    import torch
    import transformers
    from _harness import fit_one_batch

    from mfsdp_launch.components.metrics import host_values
    from mfsdp_launch.planner import prepare
    from mfsdp_launch.rank.runtime import build_training, init_runtime

    torch.manual_seed(0)
    saved = getattr(transformers, cls)(getattr(transformers, cls).config_class(
        **CLASSES[cls], architectures=[cls], output_router_logits=True, router_aux_loss_coef=0.01))
    hf_dir = out + ".hf"
    saved.save_pretrained(hf_dir)
    base = [o for o in BASE if not o.startswith("precision.compute_dtype")] + ["precision.compute_dtype=fp32"]
    cfg, _ = prepare([*base, f"model.path={hf_dir}", "model.pretrained=true"], check_hardware=False)
    rt = init_runtime(cfg.engine, cfg.mesh)
    tr = build_training(cfg, rt)
    state = tr.engine.state_dict(tr.model, None)["model"]
    want = saved.state_dict()
    mismatched = [k for k, v in state.items() if k.rsplit("module.", 1)[-1] in want and not torch.equal(
        (v.full_tensor() if hasattr(v, "full_tensor") else v).float().cpu(), want[k.rsplit("module.", 1)[-1]].float())]
    losses, metrics = fit_one_batch(tr, rt.device, each_step=lambda: host_values(tr.spec.after_step(tr.model, True)))
    Path(out).write_text(json.dumps({"losses": losses, "mismatched": mismatched, "metrics": metrics,
                                     "compared": sum(k.rsplit("module.", 1)[-1] in want for k in state)}))


def _run_case(cls: str, tmp_path) -> dict:
    from _harness import one_rank_script

    return one_rank_script(__file__, cls, tmp_path)


@pytest.mark.parametrize("cls", list(CLASSES))
def test_hf_moe_experts_are_megatron_fsdp_expert_parameters(cls, tmp_path):
    from _harness import require_gpus

    require_gpus(1)
    pytest.importorskip("transformers")
    got = _run_case(cls, tmp_path)
    assert got["losses"][-1] < got["losses"][0] - 0.5, got["losses"]
    n_moe = 2  # both layers (Qwen3-MoE's decoder_sparse_step defaults to 1)
    assert got["blocks"] == n_moe and got["n_experts"] == 2 * n_moe and got["in_expert_groups"] == got["n_experts"]
    assert got["expert_groups"] > 0 and got["expert_group"]
    f = CLASSES[cls].get("moe_intermediate_size", CLASSES[cls]["intermediate_size"])
    assert [s for k, s in got["shapes"].items() if k.endswith("model.layers.0.mlp.experts.gate_up_proj")] \
        == [[8, 2 * f, 128]], got["shapes"]


@pytest.mark.parametrize("cls", list(CLASSES))
def test_hub_format_weights_load_and_the_router_loss_trains_under_megatron_fsdp(cls, tmp_path):
    from _harness import require_gpus

    require_gpus(1)
    pytest.importorskip("transformers")
    got = _run_case(f"pretrained:{cls}", tmp_path)
    assert got["mismatched"] == [] and got["compared"] > 10, got
    assert got["losses"][-1] < got["losses"][0] - 0.5, got["losses"]
    assert len(got["metrics"]["moe_load_max"]) == 2 and got["metrics"]["moe_aux_loss"] > 0.5, got["metrics"]


if __name__ == "__main__":
    case, target = sys.argv[1], sys.argv[2]
    if case.startswith("pretrained:"):
        _pretrained_case(case.split(":", 1)[1], target)
    else:
        _case(case, target)
