"""The Llama family's mixture of experts in one process: routing and experts against a per-token
reference, capacity drops, the balancing losses and bias, the counts (parameters, active FLOPs by
hand), the one-line refusals, the dry run's expert mesh, the memory estimate under mesh.ep and
the Hugging Face export (Qwen3-MoE, Mixtral) loaded by transformers."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F

from helpers import SMOKE, model_cfg, refused
from mfsdp_launch.components.metrics import host_values
from mfsdp_launch.models import family
from mfsdp_launch.models.llama import dims as L
from mfsdp_launch.models.llama.config import MoEConfig


def gpt(**keys):
    moe = keys.pop("moe", {})
    return model_cfg("gpt", preset=keys.pop("preset", "tiny_moe"), moe=MoEConfig(**moe), **keys)


def build(m, seed=0):
    from mfsdp_launch.models.llama.gpt_modules import GPT

    torch.manual_seed(seed)
    return GPT(L.resolve_gpt_dims(m))


def reference_moe(layer, x):
    """The MoE layer token by token: softmax (or sigmoid + bias) scores, top-k, renormalized
    weights, each chosen expert's SwiGLU, plus the shared expert."""
    cfg, r = layer.cfg, layer.router
    w1, w2 = layer.experts.w_gate_up, layer.experts.w_down
    out = []
    for t in x:
        logits = (r.weight @ t).float()
        if cfg.router == "sigmoid":
            scores = torch.sigmoid(logits)
            chosen = torch.topk(scores + r.expert_bias, cfg.top_k).indices
        else:
            scores = torch.softmax(logits, -1)
            chosen = torch.topk(scores, cfg.top_k).indices
        weights = scores[chosen] / scores[chosen].sum()
        y = sum(wk * (F.silu(w1[e, :cfg.ffn_dim] @ t) * (w1[e, cfg.ffn_dim:] @ t)) @ w2[e].T
                for wk, e in zip(weights, chosen.tolist()))
        out.append(y + (layer.shared(t) if layer.shared is not None else 0))
    return torch.stack(out)


@pytest.mark.parametrize("moe", [dict(shared_experts=1), dict(router="sigmoid", top_k=1)])
def test_layer_equals_the_per_token_reference(moe):
    model = build(gpt(moe=moe))
    layer = model.layers[0].mlp
    if moe.get("router") == "sigmoid":
        layer.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))  # the bias changes the choice
    x = torch.randn(40, 64)
    with torch.no_grad():
        assert torch.allclose(layer(x[None])[0], reference_moe(layer, x), atol=1e-6)


def test_capacity_drops_the_latest_tokens_of_a_full_expert():
    model = build(gpt(moe=dict(top_k=1, capacity_factor=0.5)))
    layer = model.layers[0].mlp
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[2, 0] = 10.0  # every token with x[0] > 0 picks expert 2
    x = torch.randn(16, 64).abs()  # all pick expert 2; capacity = ceil(0.5 * 16 * 1 / 4) = 2
    with torch.no_grad():
        y = layer(x[None])[0]
    ref = reference_moe(layer, x[:2])
    assert torch.allclose(y[:2], ref, atol=1e-6)
    assert torch.equal(y[2:], torch.zeros_like(y[2:]))  # dropped: the residual carries them


def test_balancing_losses_metrics_and_the_sigmoid_bias():
    from mfsdp_launch.models.llama.moe_stats import after_step

    m = gpt(moe=dict(router="sigmoid", aux_loss_coef=0.1, z_loss_coef=0.01, bias_update_rate=0.5))
    spec = family("gpt").spec(m, 16)
    model = spec.build()
    routers = [layer.mlp.router for layer in model.layers]
    with torch.no_grad():
        routers[0].weight.zero_()  # uniform scores: the aux loss is exactly 1 however the ties fall
    ids = torch.randint(0, 256, (2, 17))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    loss = spec.loss(model, batch)
    from mfsdp_launch.models.losses import lm_loss

    assert loss.item() == lm_loss(model, batch).item()  # the logged loss stays the cross-entropy
    loss.backward()
    with_aux = routers[1].weight.grad.clone()
    load = routers[0].load.clone()
    row = host_values(after_step(model, applied=True))
    assert row["moe_load_max"][0] == pytest.approx(float(load.max() / load.mean()), rel=1e-4)
    assert len(row["moe_load_max"]) == 2 and row["moe_aux_loss"] >= 1.0
    # the overloaded experts' bias went down by the rate, the others up
    assert torch.equal(routers[0].expert_bias, 0.5 * torch.sign(load.mean() - load))
    assert routers[0].load.sum() == 0  # cleared for the next step
    model.zero_grad()
    lm_loss(model, batch).backward()
    assert not torch.allclose(with_aux, routers[1].weight.grad)  # the aux gradient reached the router
    spec.after_step(model, applied=False)
    bias = routers[0].expert_bias.clone()
    spec.loss(model, batch).backward()
    spec.after_step(model, applied=False)  # a skipped step moves nothing
    assert torch.equal(bias, routers[0].expert_bias)


def test_counts_match_the_modules_and_a_hand_count():
    for m in (gpt(), gpt(qk_norm=True, head_dim=32, n_kv_heads=2, moe=dict(shared_experts=2, every=2)),
              gpt(moe=dict(router="sigmoid"))):
        model = build(m)
        assert sum(p.numel() for p in model.parameters()) == family("gpt").param_count(m)
    # tiny_moe by hand, seq 16: per layer q/k/v/o 64*192 + 64*64, router 64*4, two experts of
    # 3 * 64 * 96; head 256 * 64; attention 12 * layers * dim * seq
    per_layer = 64 * 192 + 64 * 64 + 64 * 4 + 2 * 3 * 64 * 96
    matmul = 2 * per_layer + 256 * 64
    assert family("gpt").flops_per_token(gpt(), 16) == 6 * matmul + 12 * 2 * 64 * 16
    line = family("gpt").describe(gpt(), 16)
    assert "params=213,824 active=140,096 experts=147,456" in line
    q3 = L.resolve_gpt_dims(gpt(preset="qwen3-30b-a3b"))
    assert L.param_count(q3) == 30_532_122_624  # Qwen3-30B-A3B's own tensors
    assert L.active_params(q3) / 1e9 == pytest.approx(3.35, abs=0.01)


@pytest.mark.parametrize("overrides,key,words", [
    (["model.moe.experts=4", "model.moe.top_k=5"], "model.moe.top_k", "5 with model.moe.experts=4"),
    (["model.moe.top_k=2"], "model.moe.top_k", "dense model"),
    (["model.moe.experts=4", "model.moe.bias_update_rate=0.01"], "model.moe.bias_update_rate", "sigmoid only"),
    (["model=te_gpt", "model.moe.experts=4"], "model.moe.experts", "TE TransformerLayer"),
    (["model.moe.experts=4", "mesh.ep=3", "launcher.nproc_per_node=3"], "mesh.ep", "does not divide model.moe"),
    (["model.moe.experts=4", "mesh.ep=4"], "mesh.ep", "does not divide mesh.dp_shard*mesh.cp = 2"),
    (["mesh.ep=2"], "mesh.ep", "has none"),
    (["model.moe.experts=4", "mesh.ep=2", "sharding.zero_dp_strategy=no_shard"], "sharding.zero_dp_strategy",
     "no_shard with mesh.ep=2"),
    (["model.moe.experts=4", "mesh.ep=2", "mesh.dp_shard=1", "mesh.tp=2"], "mesh.ep", "does not divide"),
    (["model.moe.experts=4", "mesh.tp=2"], "mesh.tp", "model.moe.experts"),
])
def test_bad_moe_input_is_one_line(overrides, key, words):
    err = refused("+recipe=cpu_smoke", *overrides)
    msg = str(err)
    assert "\n" not in msg and msg.startswith(key + ": ") and words in msg, msg


def test_moe_keys_on_a_toy_are_unknown():
    assert "model.moe" in str(refused("model=toy_cnn", "model.moe.experts=4"))


def test_dry_run_shows_the_expert_mesh_and_the_memory_split():
    from rich.console import Console

    from mfsdp_launch.mesh import ParallelDims, world_size
    from mfsdp_launch.planner import prepare
    from mfsdp_launch.planner.dryrun import render
    from mfsdp_launch.planner.memory import estimate

    def dry(*overrides):
        cfg, warnings = prepare([*SMOKE, "model.moe.experts=4", *overrides, "launcher.nproc_per_node=4"],
                                check_hardware=False)
        dims = ParallelDims.from_config(cfg.mesh, world_size(cfg.launcher))
        out = io.StringIO()
        render(cfg, warnings, console=Console(file=out, width=200, highlight=False), dims=dims)
        return out.getvalue(), estimate(cfg, dims)

    text, est2 = dry("mesh.ep=2")
    assert "expert mesh: mesh.ep=2 x edp=2 (of dp_shard*cp=4): each rank holds 2 of the 4 experts" in text
    rows = [line.split() for line in text.splitlines() if line.strip().startswith(("0 ", "1 ", "2 ", "3 "))]
    assert ["3", "2-3", "2-3", "1,3"] in rows  # rank, its experts, ep group, edp group
    assert "of params+main_params+grads+optimizer: experts" in text
    _, est1 = dry("mesh.ep=1", "train.micro_batch_size=8")
    # the same sharded state; the gathered block holds half the experts
    assert est2.params == est1.params and est2.gathered_units < est1.gathered_units


def test_export_loads_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from mfsdp_launch.models.llama.hf_export import export_variant_state

    cases = {"Qwen3MoeForCausalLM": gpt(qk_norm=True, head_dim=32, n_kv_heads=2, moe=dict(every=2, top_k=3)),
             "MixtralForCausalLM": gpt(n_kv_heads=2)}
    for arch, m in cases.items():
        model = build(m).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(0.1 * torch.randn_like(p))  # norms away from 1: their mapping matters
        out = tmp_path / arch
        export_variant_state(model.state_dict(), out, dims=L.resolve_gpt_dims(m))
        hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert type(hf).__name__ == arch
        ids = torch.randint(0, 256, (2, 24))
        with torch.no_grad():
            assert (model(ids) - hf(ids).logits).abs().max() < 1e-5


def test_export_refuses_what_hf_cannot_hold():
    from mfsdp_launch.core.errors import ConfigError
    from mfsdp_launch.models.llama.hf_moe import architecture

    for moe, words in ((dict(shared_experts=1), "shared expert"), (dict(router="sigmoid"), "route by softmax"),
                       (dict(every=2), "dense layers")):
        with pytest.raises(ConfigError, match=words):
            architecture(L.resolve_gpt_dims(gpt(moe=moe)))


def test_kv_cache_decodes_a_moe_with_qk_norm_as_the_forward():
    """mfsdp-generate's cached decoder (models/llama/kv_cache.py) through qk-norm heads and MoE layers."""
    from mfsdp_launch.models.llama import kv_cache

    model = build(gpt(qk_norm=True, head_dim=32, n_kv_heads=2, moe=dict(every=2, shared_experts=1))).eval()
    ids = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        full = model(ids)
        cache = kv_cache.KVCache.for_model(model, 2, 16)
        steps = [kv_cache.prefill(model, ids[:, :8], cache)[:, -1]]
        steps += [kv_cache.decode_step(model, ids[:, t:t + 1], torch.tensor(t), cache)[:, 0] for t in range(8, 12)]
    assert torch.allclose(torch.stack(steps[:-1], 1), full[:, 7:11], atol=1e-5)


def test_activation_checkpointing_recomputes_a_moe_block_exactly_and_counts_it_once():
    from mfsdp_launch.models.activation_checkpoint import apply_activation_checkpointing

    m = gpt(moe=dict(aux_loss_coef=0.1, z_loss_coef=0.01))
    spec = family("gpt").spec(m, 16)
    ids = torch.randint(0, 256, (2, 17))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    runs = []
    for mode in ("none", "full"):
        torch.manual_seed(0)
        model = spec.build()
        if mode == "full":
            apply_activation_checkpointing(model, "full", 1)
        spec.loss(model, batch).backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        runs.append((grads, host_values(spec.after_step(model, True))))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]


def test_a_compiled_moe_breaks_only_where_shapes_or_state_need_eager_and_trains_alike():
    """torch.compile traces the router, the counts (a scatter-add, not bincount) and the routing;
    the breaks are the CPU's data-sized expert loop and the once-per-micro-batch accounting (on
    CUDA in bf16 the grouped GEMM is traced too). Compiled and eager give the same loss, gradients
    and load metrics."""
    from mfsdp_launch.models.llama.moe import moe_layers

    m = gpt(moe=dict(aux_loss_coef=0.1, z_loss_coef=0.01))
    spec = family("gpt").spec(m, 16)
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    layer = moe_layers(build(m))[0]
    explained = torch._dynamo.explain(layer)(torch.randn(2, 8, layer.router.weight.shape[1]))
    reasons = [str(b.reason).splitlines()[0] for b in explained.break_reasons]
    assert reasons and all("torch.compiler.disable()" in r for r in reasons), reasons
    runs = []
    for compiled in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = spec.build()
        run = torch.compile(model, backend="aot_eager") if compiled else model
        losses = []
        for _ in range(2):  # the second step: the compiled graphs reused, the accounting again
            loss = spec.loss(run, batch)
            loss.backward()
            losses.append(loss.item())
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        runs.append((losses, grads, host_values(spec.after_step(model, True))))
    (l0, g0, s0), (l1, g1, s1) = runs
    assert l0 == pytest.approx(l1, rel=1e-6) and torch.allclose(g0, g1, rtol=1e-5, atol=1e-7)
    assert s0 == s1 and s0["moe_load_max"], (s0, s1)
