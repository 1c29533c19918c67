"""Hugging Face mixtures of experts under `model=hf` (models/hf/moe.py, models/hf/expert_parallel.py):
FLOPs and the parameter line count the experts a token uses (a hand count, Qwen3-MoE with a dense
layer and Mixtral), what mesh.ep cannot split is one line before spawning, and on 2 gloo ranks a
tiny Qwen3-MoE and a tiny Mixtral (local directories) train at mesh.ep=2 the losses and gradient
norms of mesh.ep=1 through the worker's wiring, each rank holding experts/ep experts under the
HF parameter names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import model_cfg, read_metrics, refused, run_ranks

transformers = pytest.importorskip("transformers")

DIM, SEQ, VOCAB = 32, 16, 256
COMMON = dict(hidden_size=DIM, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=False)
# Qwen3-MoE with MoE in layer 1 only (decoder_sparse_step=2): layer 0 keeps a dense MLP of 64.
QWEN3 = dict(COMMON, head_dim=8, intermediate_size=64, moe_intermediate_size=48, num_experts=4,
             num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[])
MIXTRAL = dict(COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
CLASSES = {"Qwen3MoeForCausalLM": QWEN3, "MixtralForCausalLM": MIXTRAL}
STEPS = 3


def hf(cls: str, **fields):
    return model_cfg("hf", hf_class=cls, hf_config=dict(CLASSES.get(cls, COMMON), **fields))


def flags(cls: str, **fields) -> list:
    """The config-dict overrides of an HF model (Hydra's dict syntax)."""
    body = ", ".join(f"{k}: {json.dumps(v)}" for k, v in dict(CLASSES.get(cls, COMMON), **fields).items())
    return ["model=hf", f"model.hf_class={cls}", f"model.hf_config={{{body}}}"]


def test_flops_and_the_parameter_line_count_the_active_experts():
    from mfsdp_launch.models import family

    fam = family("hf")
    attention = DIM * DIM + 2 * DIM * 16 + DIM * DIM  # q, k, v (2 kv heads of 8), o
    head = VOCAB * DIM
    # Qwen3-MoE: layer 0 a dense SwiGLU of 64, layer 1 a router and 4 experts of 48 (2 per token)
    expert = 3 * DIM * 48
    total = 2 * head + 2 * (attention + 2 * 8 + 2 * DIM) + 3 * DIM * 64 + DIM * 4 + 4 * expert + DIM
    active_matmul = 2 * attention + 3 * DIM * 64 + DIM * 4 + 2 * expert + head
    m = hf("Qwen3MoeForCausalLM")
    assert fam.param_count(m) == total and fam.active_params(m) == total - 2 * expert
    assert fam.flops_per_token(m, SEQ) == 6 * active_matmul + 12 * 2 * DIM * SEQ
    assert (fam.experts(m), fam.expert_params(m), fam.unit_expert_params(m)) == (4, 4 * expert, 4 * expert)
    assert f"params={total:,} active={total - 2 * expert:,} experts={4 * expert:,}" in fam.describe(m, SEQ)
    assert fam.spec(m, SEQ).flops_per_token == fam.flops_per_token(m, SEQ)
    # Mixtral: MoE in both layers, no q/k norms
    m = hf("MixtralForCausalLM")
    total = 2 * head + 2 * (attention + DIM * 4 + 4 * expert + 2 * DIM) + DIM
    assert fam.active_params(m) == total - 2 * 2 * expert
    assert fam.flops_per_token(m, SEQ) == 6 * (2 * (attention + DIM * 4 + 2 * expert) + head) + 12 * 2 * DIM * SEQ
    assert "(moe: 4 experts, top_k=2, in 2 of 2 layers)" in fam.describe(m, SEQ)
    dense = model_cfg("hf", hf_class="LlamaForCausalLM", hf_config=dict(COMMON, intermediate_size=64))
    assert fam.experts(dense) == 0 and fam.active_params(dense) == fam.param_count(dense)
    assert "active=" not in fam.describe(dense, SEQ)


@pytest.mark.parametrize("overrides,words", [
    (flags("Qwen3MoeForCausalLM") + ["mesh.ep=3", "launcher.nproc_per_node=3"],
     "mesh.ep: 3 does not divide Qwen3MoeForCausalLM's num_experts=4"),
    (flags("MixtralForCausalLM") + ["mesh.ep=4"], "does not divide mesh.dp_shard*mesh.cp = 2"),
    (flags("LlamaForCausalLM", intermediate_size=64) + ["mesh.ep=2"], "model=hf LlamaForCausalLM has none"),
    (flags("Qwen2MoeForCausalLM", moe_intermediate_size=48, shared_expert_intermediate_size=64, num_experts=4,
           num_experts_per_tok=2, intermediate_size=64) + ["mesh.ep=2"],
     "Qwen2MoeForCausalLM (model_type 'qwen2_moe') has experts blocks that mesh.ep does not split "
     "(it splits MixtralForCausalLM, Qwen3MoeForCausalLM)"),
    (flags("Qwen3MoeForCausalLM", hidden_act="gelu") + ["mesh.ep=2"], "hidden_act='gelu'"),
    (flags("MixtralForCausalLM") + ["mesh.ep=2", "engine=megatron_fsdp"], "engine=megatron_fsdp does not split"),
])
def test_what_mesh_ep_cannot_split_is_one_line(overrides, words):
    msg = str(refused("+recipe=cpu_smoke", *overrides))
    assert "\n" not in msg and msg.startswith("mesh.ep: ") and words in msg, msg


# ------------------------------------------------------------------ 2 gloo ranks: ep=2 == ep=1


def _overrides(hf_dir: str, ep: int, run: Path, world: int) -> list:
    return ["model=hf", f"model.path={hf_dir}", "engine=fsdp2", "data=synthetic", "precision.compute_dtype=fp32",
            "precision.main_params_dtype=fp32", f"train.seq_len={SEQ}", f"train.steps={STEPS}",
            "train.micro_batch_size=2", "train.grad_accum_steps=1", "train.log_interval=1", "train.progress=false",
            "optim.lr=1e-2", "optim.warmup_steps=0", f"launcher.nproc_per_node={world}", f"mesh.ep={ep}",
            f"run.dir={run}", "checkpoint.save_final=false", "checkpoint.interval_minutes=null"]


def _ranks_ep(rank, world, out, *dirs):
    import torch

    from helpers import train_wired

    torch.set_num_threads(1)
    shapes = {}
    for hf_dir in dirs:
        for ep in (1, 2):
            run = Path(out) / f"{Path(hf_dir).name}-ep{ep}"
            _, tr = train_wired(rank, world, _overrides(hf_dir, ep, run, world))
            blocks = [m for m in tr.model.modules() if getattr(m, "is_expert_module", False)]
            w = blocks[0].gate_up_proj
            shapes[run.name] = {"blocks": len(blocks), "global": list(w.shape), "local": list(w.to_local().shape),
                                "mesh": list(w.device_mesh.mesh_dim_names),
                                "names": sorted(n.rsplit(".", 1)[-1] for n, _ in blocks[0].named_parameters()),
                                "split": "forward" in vars(blocks[0])}
    Path(out, f"rank{rank}.json").write_text(json.dumps(shapes))


def test_ep2_trains_as_ep1_on_two_ranks(tmp_path):
    dirs = []
    for cls, fields in CLASSES.items():
        config = getattr(transformers, cls).config_class(**fields, architectures=[cls])
        config.save_pretrained(tmp_path / cls)
        dirs.append(str(tmp_path / cls))
    run_ranks(_ranks_ep, 2, str(tmp_path), *dirs, timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for cls, fields in CLASSES.items():
        rows = {ep: [r for r in read_metrics(tmp_path / f"{cls}-ep{ep}") if "loss" in r] for ep in (1, 2)}
        # random tokens: the loss moves (it trains) but cannot fall below ln(vocab)
        assert [r["step"] for r in rows[2]] == list(range(1, STEPS + 1)) and len({r["loss"] for r in rows[2]}) == STEPS
        for key in ("loss", "grad_norm"):  # a mis-scaled expert gradient shows in the norm first
            one, two = [r[key] for r in rows[1]], [r[key] for r in rows[2]]
            assert len(one) == len(two) and max(abs(a - b) / abs(a) for a, b in zip(one, two)) < 1e-5, (cls, key, one, two)
        n_moe = 1 if cls.startswith("Qwen3") else 2
        # models/hf/router_loss.py: the global expert loads per MoE layer (the same routing at any ep)
        for one, two in zip(rows[1], rows[2]):
            assert len(two["moe_load_max"]) == n_moe and two["moe_load_max"] == pytest.approx(one["moe_load_max"])
            assert two["moe_aux_loss"] == pytest.approx(one["moe_aux_loss"], rel=1e-5) and two["moe_aux_loss"] > 0.5
        f = fields.get("moe_intermediate_size", fields["intermediate_size"])
        for shapes in ranks:
            one, two = shapes[f"{cls}-ep1"], shapes[f"{cls}-ep2"]
            assert one["blocks"] == two["blocks"] == n_moe and not one["split"] and two["split"]
            assert one["global"] == two["global"] == [4, 2 * f, DIM]
            assert two["names"] == ["down_proj", "gate_up_proj"]  # HF's own names: load, export, DCP keys
            # ep=2, edp=1: this rank's 2 of the 4 experts, on the (edp, ep) expert mesh
            assert two["local"] == [2, 2 * f, DIM] and two["mesh"] == ["edp", "ep"]
