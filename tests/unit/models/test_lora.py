"""LoRA (model.peft, models/lora.py) in this process: every bad model.peft is one line before
anything would spawn, and the memory estimate gives the adapters alone gradients, main weights
and optimizer state. (Training, checkpoints and exports: tests/e2e/test_lora_e2e.py.)"""

from __future__ import annotations

import pytest

import importlib.util

from helpers import refused, write_llama_dir

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
# Validation only looks peft up (importing it takes seconds); so does this file.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft")

LORA = "model.peft.kind=lora"
QLORA = "model.peft.kind=qlora"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_llama_dir(tmp_path_factory.mktemp("base") / "llama")


GPT = ["model=gpt", "model.init_from={base}"]
HF = ["model=hf", "model.path={base}", "model.pretrained=true"]
GPT_NAMES = "lm_head, w_down, w_gate_up, wo, wqkv"


@pytest.mark.parametrize("overrides, key, says", [
    ([LORA, "model.peft.targets=[wqkv]"], "model.init_from", "null gives model=gpt no pretrained base"),
    (["model=hf", "model.path={base}", LORA, "model.peft.targets=[q_proj]"], "model.pretrained",
     "false gives model=hf no pretrained base"),
    ([*GPT, LORA], "model.peft.targets", f"empty: name the linear layers of model=gpt that get adapters "
                                         f"(allowed: entries of {GPT_NAMES})"),
    ([*GPT, LORA, "model.peft.targets=[q_proj]"], "model.peft.targets", f"'q_proj' matches no module of "
                                                                        f"model=gpt; its linear layers are named (allowed: {GPT_NAMES})"),
    ([*HF, LORA, "model.peft.targets=[wqkv]"], "model.peft.targets",
     "'wqkv' matches no module of model=hf; its linear layers are named (allowed: down_proj, gate_proj, k_proj, "
     "lm_head, o_proj, q_proj, up_proj, v_proj)"),
    ([*GPT, LORA, "model.peft.targets=[attn]"], "model.peft.targets", "'attn' matches layers.0.attn, which is not "
                                                                      "a linear layer"),
    ([*GPT, LORA, "model.peft.targets=[wqkv]", "model.peft.r=0"], "model.peft.r", "must be >= 1, got 0"),
    ([*GPT, LORA, "model.peft.targets=[wqkv]", "model.peft.alpha=0"], "model.peft.alpha", "must be > 0"),
    ([*GPT, LORA, "model.peft.targets=[wqkv]", "model.peft.dropout=1"], "model.peft.dropout", "must be in [0, 1)"),
    ([*GPT, "model.peft.r=4"], "model.peft.r", "is read by model.peft.kind=lora|qlora only, not none"),
    (["model=toy_transformer", LORA], "model.peft.kind",
     "lora: model=toy_transformer cannot take LoRA adapters here (allowed: none, or model=gpt|hf)"),
    ([*GPT, LORA, "model.peft.targets=[wqkv]", "model.freeze=[tok_emb.*]"], "model.freeze",
     "LoRA freezes every weight of the base already"),
    ([*GPT, LORA, "model.peft.targets=[wqkv]", "mesh.tp=2", "launcher.nproc_per_node=2"], "mesh.tp",
     "2 with LoRA: adapters on tensor-parallel layers are not wired"),
    ([*GPT, LORA, "model.peft.targets=[wqkv]", "engine=megatron_fsdp", "optim.impl=te_fused",
      "train.cuda_graph=full_iteration"], "train.cuda_graph", "full_iteration with LoRA was never captured here"),
    ([*GPT, QLORA, "model.peft.targets=[wqkv]", "engine=megatron_fsdp"], "model.peft.kind",
     "qlora runs under engine=fsdp2 only: engine=megatron_fsdp shards every parameter it holds"),
    ([*GPT, QLORA, "model.peft.targets=[wqkv]", "engine=fsdp2", "train.compile=true"], "train.compile",
     "true with model.peft.kind=qlora was never run here"),
])
def test_bad_lora_config_is_one_line_before_spawning(base, overrides, key, says):
    err = refused(*(o.format(base=base) for o in overrides))
    assert err.key == key and says in str(err) and "\n" not in str(err), str(err)


def test_te_gpt_cannot_take_lora():
    from helpers import model_cfg
    from mfsdp_launch.core.errors import ConfigError
    from mfsdp_launch.models import FAMILIES, lora

    m = model_cfg("te_gpt")
    m.peft.kind = "lora"
    with pytest.raises(ConfigError) as e:
        lora.check_config(m, FAMILIES["te_gpt"], seq_len=16, tp=1, cuda_graph=False,
                          lora_families=["gpt", "hf"])
    assert str(e.value) == "model.peft.kind: lora: model=te_gpt cannot take LoRA adapters here (allowed: none, or model=gpt|hf)"


def test_the_memory_estimate_gives_only_the_adapters_gradients_and_optimizer_state():
    from mfsdp_launch.mesh import ParallelDims
    from mfsdp_launch.models import family, lora
    from mfsdp_launch.planner.compose import compose
    from mfsdp_launch.planner.memory import estimate

    common = ["model.preset=1.4b", "precision.compute_dtype=bf16", "precision.main_params_dtype=fp32",
              "launcher.nproc_per_node=8"]
    peft = "model.peft={kind: lora, r: 16, targets: [wqkv, wo, w_gate_up, w_down]}"
    for engine in ("megatron_fsdp", "fsdp2"):
        full, lo = (compose([f"engine={engine}", *common, *extra]) for extra in ([], [peft]))
        dims = ParallelDims.from_config(full.mesh, 8)
        a, b = estimate(full, dims), estimate(lo, dims)
        n = family("gpt").param_count(lo.model)
        adapters = lora.adapter_params(family("gpt").modules(lo.model, lo.train.seq_len), lo.model.peft)
        assert 0 < adapters < 0.02 * n
        assert b.optimizer == pytest.approx(a.optimizer * adapters / n)
        assert b.main_params == pytest.approx(a.main_params * adapters / n)
        # The frozen base: bf16 weights only (its fp32 main copy is gone under FSDP2 too).
        assert b.params == pytest.approx((n * 2 + adapters * (2 if engine == "megatron_fsdp" else 0)) / 8)
        assert b.grads == pytest.approx(a.grads * adapters / n)


def test_qlora_refuses_an_fp8_recipe_in_one_line():
    from mfsdp_launch.core.errors import ConfigError
    from mfsdp_launch.models import qlora

    with pytest.raises(ConfigError) as e:
        qlora.check_config(engine="fsdp2", fp8_recipe="torchao_rowwise", compiled=False)
    assert e.value.key == "fp8.recipe" and "NF4, which no FP8 recipe converts" in str(e.value)


def test_the_memory_estimate_keeps_the_qlora_base_in_nf4_on_every_rank():
    from mfsdp_launch.mesh import ParallelDims
    from mfsdp_launch.models import family, qlora
    from mfsdp_launch.planner.compose import compose
    from mfsdp_launch.planner.memory import estimate

    common = ["engine=fsdp2", "model.preset=1.4b", "precision.compute_dtype=bf16", "precision.main_params_dtype=fp32",
              "launcher.nproc_per_node=8"]
    lo, q = (compose([*common, f"model.peft={{kind: {k}, r: 16, targets: [wqkv, wo, w_gate_up, w_down]}}"])
             for k in ("lora", "qlora"))
    dims = ParallelDims.from_config(lo.mesh, 8)
    a, b = estimate(lo, dims), estimate(q, dims)
    nf4 = qlora.nf4_params(family("gpt").modules(q.model, q.train.seq_len))
    assert nf4 > 0.8 * family("gpt").param_count(q.model)  # the 1.4b's blocks: every projection
    # bf16 sharded 8 ways -> NF4 whole on each rank; the gathered units lose those weights
    assert b.params == pytest.approx(a.params - nf4 * 2 / 8 + nf4 * qlora.NF4_BYTES)
    assert b.gathered_units < 0.2 * a.gathered_units
    assert (b.optimizer, b.grads, b.main_params) == (a.optimizer, a.grads, a.main_params)


def test_qlora_quantizes_every_frozen_linear_but_the_head_adapted_or_not():
    pytest.importorskip("torchao")
    from helpers import model_cfg
    from mfsdp_launch.core.schema import PeftConfig
    from mfsdp_launch.models import family, lora, qlora

    m = model_cfg("gpt", preset="tiny", dim=128, ffn_dim=256, vocab_size=256)
    m.peft = PeftConfig(kind="qlora", r=2, alpha=4.0, targets=["wqkv"])
    spec = family("gpt").spec(m, 16)
    model = spec.build()
    line = lora.adapt(spec, model, m.peft)
    marked = {id(p) for p in qlora.replicated(model)}
    linears = {n: mod for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    for name, mod in linears.items():
        frozen_body = not mod.weight.requires_grad and name != "lm_head"
        assert (id(mod.weight) in marked) == frozen_body, name
    assert any(n.endswith("w_down") for n, mod in linears.items() if id(mod.weight) in marked)  # not adapted
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        before = model(ids)
        line += qlora.quantize_base(model)
        after = model(ids)
    from torchao.quantization import NF4Tensor

    assert all(isinstance(p.data, NF4Tensor) for p in qlora.replicated(model))
    assert f"qlora: {len(marked)} base weights in NF4" in line
    rel = ((after - before).norm() / before.norm()).item()
    assert 0 < rel < 0.2, rel  # NF4's error (4 bits a weight), no more
