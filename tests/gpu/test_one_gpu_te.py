"""One GPU with Transformer Engine (every test here is test_te_*; all skip without TE):

* in one process (_harness.py job, mesh (1, 1, 1, 1)): Megatron-FSDP with FP8 parameters per
  recipe (delayed, current, blockwise; meta init or not), the FP8 delayed-scaling checkpoint
  round trip (the resumed steps match), custom dtypes with FP8 parameters, full-iteration CUDA
  graphs with FusedAdam (the seed's toy, and the GPT with the loop's clipping/schedule), the TE toy
  transformer's DCP round trip and fully_shard under every ZeRO level, and
  engine.fuse_wgrad_accumulation's gradients over two micro-batches against the unfused engine's;
* through the CLI: te_gpt under each FP8 recipe Hopper runs (fp8.recipe=delayed|current|blockwise)
  and with FP8 parameters (fp8.params=true) trains and follows the bf16 curve without equalling
  it (FP8 parameters built on the meta device: te_gpt refuses fp8.params without
  model.init_on_meta=true before spawning, since TE's init of them on the GPU fails); an FP8 delayed run resumes from its checkpoint with the uninterrupted losses;
  fp8.attention=true changes the numbers (FP8 attention ran) and trains; model.loss_kernel=te_fused
  gives the torch loss; train.cuda_graph=full_iteration gives the eager losses and saves; and
  fp8.recipe=mxfp8 on a pre-Blackwell GPU is one line, exit code 2; engine.fuse_wgrad_accumulation=true
  at two micro-batches a step follows the unfused losses;
* data.doc_mask on te_gpt (bf16, GQA): TE's DotProductAttention runs THD over the flattened batch, each
  document of a packed row gives the logits it gives alone, no gradient crosses a document (exactly
  zero), and packed training runs through the CLI (megatron_fsdp, with and without activation
  checkpointing; engine=fsdp2 is refused); te_gpt trains under fsdp2 without masks.
"""

from __future__ import annotations

import math

import pytest

import _one_gpu as G
from _harness import Job, case, gpu_count, require_gpus, require_te
from _one_gpu import assert_close, assert_learns, uses
from test_megatron_fsdp import ZEROS, _check_custom, _check_dcp, _check_fully_shard

pytestmark = pytest.mark.gpu

MESH = (1, 1, 1, 1)
RECIPES = ["delayed", "current", "blockwise"]  # mxfp8 needs Blackwell (test_te_cli_mxfp8_...)
JOB = Job("one_gpu_te", 1, MESH, timeout=480)
CUSTOM = [(z, mg) for z in ZEROS[1:] for mg in (None, "fp32")]

for _r in RECIPES:
    for _meta in (True, False):
        JOB.add(f"quant-{_r}-meta{_meta}", "te_quantized", recipe=_r, meta=_meta)
JOB.add("fp8-ckpt-delayed", "fp8_checkpoint")
for _z, _mg in CUSTOM:
    JOB.add(f"custom-{_z}-{_mg}", "custom_dtype", model="te_toy_fp8", zero=_z, outer="no_shard", main_params="fp64",
            main_grads=_mg)
for _z in ZEROS:
    JOB.add(f"dcp-{_z}", "dcp_roundtrip", model="te_toy_transformer", zero=_z, outer="no_shard")
    JOB.add(f"fs-{_z}", "fully_shard", model="te_toy_transformer", zero=_z, outer="no_shard", preserve_fp32=False,
            meta=False, compile=False)
# engine.fuse_wgrad_accumulation over two micro-batches; on one GPU every gradient buffer is unsharded
WGRAD = [(z, mg) for z in ("optim", "optim_grads_params") for mg in (None, "fp32")]
WGRAD_JOB = Job("one_gpu_te_wgrad", 1, MESH, timeout=240)
for _z, _mg in WGRAD:
    WGRAD_JOB.add(f"wgrad-{_z}-{_mg}", "_te_jobs:wgrad_fusion", zero=_z, main_grads=_mg)
JOB.add("graph-toy", "cuda_graph", outer="no_shard")
JOB.add("graph-gpt-loop", "cuda_graph", outer="no_shard", model="gpt_tiny", compute="bf16", loop_extras=True)


@pytest.fixture
def te_gpu(request):
    require_gpus(1)
    require_te()
    G.start(request)


# ------------------------------------------------------------------------------- in one process


@pytest.mark.parametrize("meta", [True, False])
@pytest.mark.parametrize("recipe", RECIPES)
def test_te_fp8_params_per_recipe_one_gpu(te_gpu, recipe, meta):
    (d,) = case(JOB, f"quant-{recipe}-meta{meta}")
    assert all(math.isfinite(x) for x in d["losses"]), d
    assert d["n_quantized_params"] > 0, "no FP8 primary weights were created"


def test_te_fp8_delayed_checkpoint_round_trip_one_gpu(te_gpu):
    (d,) = case(JOB, "fp8-ckpt-delayed")
    assert d["n_te_modules_with_state"] > 0, d
    assert d["history_restored"], d
    assert d["history_differs_without"], d
    for a, b in zip(d["resumed"], d["uninterrupted"]):
        assert abs(a - b) <= 1e-4 * abs(b), d


@pytest.mark.parametrize("zero,main_grads", CUSTOM, ids=str)
def test_te_custom_dtype_fp8_params_one_gpu(te_gpu, zero, main_grads):
    _check_custom(case(JOB, f"custom-{zero}-{main_grads}"))


@pytest.mark.parametrize("zero", ZEROS)
def test_te_toy_dcp_checkpoint_one_gpu(te_gpu, zero):
    _check_dcp(case(JOB, f"dcp-{zero}"), "te_toy_transformer", zero)


@pytest.mark.parametrize("zero", ZEROS)
def test_te_toy_fully_shard_one_gpu(te_gpu, zero):
    _check_fully_shard(case(JOB, f"fs-{zero}"))


@pytest.mark.parametrize("zero,main_grads", WGRAD, ids=str)
def test_te_wgrad_fusion_accumulates_micro_batches_one_gpu(te_gpu, zero, main_grads):
    """TE's wgrad GEMMs write into Megatron-FSDP's buffer and the two micro-batches' gradients add
    up as unfused; under the library's own overwrite flag only the last one would be kept."""
    (d,) = case(WGRAD_JOB, f"wgrad-{zero}-{main_grads}")
    print(f"wgrad fusion {zero} main_grads={main_grads}: {d['fused']['fused_modules']} TE modules fused, max "
          f"relative gradient difference {d['fused']['max_rel_diff']:.2e} ({d['fused']['worst']}); uncorrected "
          f"overwrite: {d['naive']['max_rel_diff']:.2e}")
    assert d["fused"]["fused_modules"] >= 3, d  # a layer's QKV, projection and MLP at least
    assert not d["fused"]["missing"], d
    assert d["fused"]["max_rel_diff"] < 2e-2, d
    assert d["naive"]["max_rel_diff"] > 0.1, d  # the test tells a kept-last-micro-batch buffer apart


@pytest.mark.parametrize("name", ["graph-toy", "graph-gpt-loop"])
def test_te_full_iteration_cuda_graph_one_gpu(te_gpu, name):
    (d,) = case(JOB, name)
    assert d["capturable"]
    assert all(math.isfinite(x) for x in d["losses"]), d["losses"]
    assert all(d["grads_present"]), d["grads_present"]
    assert d["losses"][-1] < d["losses"][0], d["losses"]


# ------------------------------------------------------------------------------- through the CLI

SEQ = 128
# te_gpt with head_dim 128 (FP8 attention's), every GEMM dimension a multiple of 128 (blockwise)
TE = ["engine=megatron_fsdp", "model=te_gpt", "model.preset=tiny", "model.dim=256", "model.n_heads=2",
      "model.n_kv_heads=2", "model.ffn_dim=512", "data=text", f"data.path={G.window_file(SEQ)}",
      f"train.seq_len={SEQ}", "train.micro_batch_size=2", "train.log_interval=1", "train.progress=false",
      "optim.lr=3e-3", "optim.warmup_steps=0", "optim.decay_steps=50", "precision.compute_dtype=bf16",
      "precision.main_params_dtype=fp32", "precision.main_grads_dtype=fp32"]
STEPS = 6
ONCE = [f"train.steps={STEPS}", "checkpoint.save_final=false"]
# the torch GPT in bf16 with TE's FusedAdam: eager against a full-iteration CUDA graph
GRAPH = ["engine=megatron_fsdp", "model=gpt", "model.preset=tiny", "data=text", f"data.path={G.window_file(64)}",
         "train.seq_len=64", "train.micro_batch_size=4", "train.log_interval=1", "train.progress=false",
         "optim.lr=3e-3", "optim.warmup_steps=0", "optim.decay_steps=50", "precision.compute_dtype=bf16",
         "precision.main_params_dtype=fp32", "precision.main_grads_dtype=fp32", "optim.impl=te_fused",
         f"train.steps={STEPS}"]

G.train("te_delayed", *TE, f"train.steps={STEPS}", "checkpoint.interval=3", "fp8.recipe=delayed", needs_te=True,
        priority=0)
G.train("te_delayed_c", *TE, f"train.steps={STEPS}", "checkpoint.interval=3", "fp8.recipe=delayed", needs_te=True,
        after=["te_delayed"], prepare=G.copy_checkpoint("te_delayed", 3), priority=0)
G.train("te_bf16", *TE, *ONCE, needs_te=True, priority=0)
for _r in RECIPES[1:]:
    G.train(f"te_{_r}", *TE, *ONCE, f"fp8.recipe={_r}", needs_te=True)
for _r in RECIPES:
    G.train(f"te_params_{_r}", *TE, *ONCE, f"fp8.recipe={_r}", "fp8.params=true", "engine.keep_fp8_transpose_cache=true",
            "model.init_on_meta=true",
            needs_te=True)
G.train("te_attention", *TE, *ONCE, "fp8.recipe=delayed", "fp8.attention=true", needs_te=True)
G.train("te_fused_loss", *TE, *ONCE, "model.loss_kernel=te_fused", needs_te=True)
G.train("gpt_graph", *GRAPH, "train.cuda_graph=full_iteration", needs_te=True)
G.train("gpt_eager_fusedadam", *GRAPH, "checkpoint.save_final=false", needs_te=True)
G.train("te_mxfp8", *TE, *ONCE, "fp8.recipe=mxfp8", needs_te=True)
G.train("te_ga2", *TE, *ONCE, "train.grad_accum_steps=2", needs_te=True)
G.train("te_ga2_wgrad", *TE, *ONCE, "train.grad_accum_steps=2", "engine.fuse_wgrad_accumulation=true", needs_te=True)
# Megatron-FSDP's gradients in param.decoupled_grad: TE's FusedAdam must read them there (session
# 28's fix; before it no weight moved).
G.train("gpt_decoupled_grad", *GRAPH, "checkpoint.save_final=false", "engine.use_decoupled_grad=true", needs_te=True)


def _recipe_run(recipe: str) -> str:
    return "te_delayed" if recipe == "delayed" else f"te_{recipe}"


def _differs(got, ref):
    return max(abs(got[s] - ref[s]) for s in ref if s in got) > 0


@pytest.mark.parametrize("recipe", RECIPES)
@uses("te_bf16", lambda p: [_recipe_run(p["recipe"])])
def test_te_cli_fp8_recipe_trains_near_bf16(request, te_gpu, recipe):
    ref = G.get(request, "te_bf16").ok().losses()
    assert_learns(ref, STEPS, min_drop=0.5, what="bf16")
    r = G.get(request, _recipe_run(recipe)).ok()
    assert str(r.config().fp8.recipe) == recipe
    got = r.losses()
    assert_learns(got, STEPS, min_drop=0.5, what=recipe)
    assert _differs(got, ref), f"fp8.recipe={recipe} gave bf16's losses exactly: FP8 did not run"
    assert_close(got, ref, range(1, STEPS + 1), rel=0.05, what=f"fp8 {recipe} vs bf16")


@pytest.mark.parametrize("recipe", RECIPES)
@uses("te_bf16", lambda p: [f"te_params_{p['recipe']}"])
def test_te_cli_fp8_params_train_near_bf16(request, te_gpu, recipe):
    ref = G.get(request, "te_bf16").ok().losses()
    r = G.get(request, f"te_params_{recipe}").ok()
    assert r.config().fp8.params is True
    got = r.losses()
    assert_learns(got, STEPS, min_drop=0.5, what=f"fp8.params {recipe}")
    assert _differs(got, ref)
    assert_close(got, ref, range(1, STEPS + 1), rel=0.05, what=f"fp8 params {recipe} vs bf16")


@uses("te_delayed", "te_delayed_c")
def test_te_cli_fp8_delayed_resume_continues_the_losses(request, te_gpu):
    """The delayed-scaling amax history and scales travel in the checkpoint: steps 4-6 after a
    resume from step_3 give the uninterrupted run's losses."""
    ref = G.get(request, "te_delayed").ok().losses()
    r = G.get(request, "te_delayed_c").ok()
    assert "resuming from step 3" in r.stdout, r.tail()
    got = r.losses()
    assert sorted(got) == [4, 5, 6], sorted(got)
    assert_close(got, ref, range(4, 7), rel=1e-3, what="fp8 delayed resumed vs uninterrupted")


@uses("te_delayed", "te_attention")
def test_te_cli_fp8_attention_runs_and_trains(request, te_gpu):
    ref = G.get(request, "te_delayed").ok().losses()
    r = G.get(request, "te_attention").ok()
    assert r.config().fp8.attention is True
    got = r.losses()
    assert_learns(got, STEPS, min_drop=0.5, what="fp8 attention")
    assert _differs(got, ref), "fp8.attention=true gave the bf16-attention losses exactly: it did not run"
    assert_close(got, ref, range(1, STEPS + 1), rel=0.05, what="fp8 attention vs bf16 attention")


@uses("te_bf16", "te_fused_loss")
def test_te_cli_fused_loss_gives_the_torch_loss(request, te_gpu):
    ref = G.get(request, "te_bf16").ok().losses()
    r = G.get(request, "te_fused_loss").ok()
    assert str(r.config().model.loss_kernel) == "te_fused"
    got = r.losses()
    assert_close(got, ref, [1], rel=1e-3, what="step 1: fused vs torch cross-entropy")
    assert_close(got, ref, range(1, STEPS + 1), rel=2e-2, what="fused loss vs torch loss")


@uses("gpt_graph", "gpt_eager_fusedadam")
def test_te_cli_full_iteration_cuda_graph_gives_the_eager_losses(request, te_gpu):
    ref = G.get(request, "gpt_eager_fusedadam").ok().losses()
    assert_learns(ref, STEPS, min_drop=0.5, what="eager")
    r = G.get(request, "gpt_graph").ok()
    assert str(r.config().train.cuda_graph) == "full_iteration"
    assert_close(r.losses(), ref, range(1, STEPS + 1), rel=1e-2, what="CUDA graph vs eager")
    assert (r.run_dir / "checkpoints" / f"step_{STEPS}" / "manifest.json").is_file()


@uses("gpt_eager_fusedadam", "gpt_decoupled_grad")
def test_te_cli_decoupled_grads_train_as_main_grads_do(request, te_gpu):
    ref = G.get(request, "gpt_eager_fusedadam").ok().losses()
    r = G.get(request, "gpt_decoupled_grad").ok()
    assert r.config().engine.use_decoupled_grad is True
    assert_learns(r.losses(), STEPS, min_drop=0.5, what="use_decoupled_grad")
    # The same fp32 gradients, read from another attribute: the same updates.
    assert_close(r.losses(), ref, range(1, STEPS + 1), rel=1e-5, what="decoupled_grad vs main_grad")


@uses("te_mxfp8")
def test_te_cli_mxfp8_is_refused_in_one_line_before_hopper_trains(request, te_gpu):
    import torch

    cap = torch.cuda.get_device_capability(0) if gpu_count() else (0, 0)
    if cap >= (10, 0):
        pytest.skip(f"this GPU ({cap[0]}.{cap[1]}) runs MXFP8")
    r = G.get(request, "te_mxfp8")
    assert r.rc == 2, r.tail()
    lines = [x for x in r.console.splitlines() if "'mxfp8' needs compute capability 10.0+" in x]
    assert lines and lines[0].startswith("mfsdp-train: error: fp8.recipe:"), r.tail()
    assert "Traceback" not in r.console, r.tail()
    assert not (r.run_dir / "metrics.jsonl").exists() or not r.rows()


# ------------------------------------------------------------------------------- document masks (THD)

# data.doc_mask on te_gpt: TE's THD attention per document (models/llama/te_modules.py), GQA, bf16.
DOCS = [(37, 50, 41), (64, 64)]  # row 0: three documents; row 1: two (cu_seqlens cut at the row end too)


def _te_gpt_bf16():
    import torch

    from mfsdp_launch.models.llama.dims import GPTDims
    from mfsdp_launch.models.llama.te_modules import TEGPT

    torch.manual_seed(0)
    dims = GPTDims(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=256, tie_embeddings=False,
                   norm_eps=1e-5, rope_theta=10000.0)
    return TEGPT(dims, params_dtype=torch.bfloat16).cuda()


def _packed_batch():
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(1, 256, (len(DOCS), sum(DOCS[0])), device="cuda", generator=g)
    doc_ids = torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in DOCS]).cuda()
    return ids, doc_ids


def _attention_layouts(model) -> tuple:
    """(records, hooks): the qkv_format and query shape of every call of TE's DotProductAttention."""
    seen = []

    def record(module, args, kwargs):
        seen.append((kwargs.get("qkv_format"), tuple(args[0].shape)))

    return seen, [layer.self_attention.core_attention.register_forward_pre_hook(record, with_kwargs=True)
                  for layer in model.layers]


def test_te_gpt_doc_mask_packed_documents_equal_documents_alone():
    require_gpus(1)
    require_te()
    import torch

    from mfsdp_launch.corpus import cu_seqlens
    from mfsdp_launch.models.doc_attention import KERNELS

    model = _te_gpt_bf16()
    ids, doc_ids = _packed_batch()
    layers, T = len(model.layers), ids.shape[1]
    seen, hooks = _attention_layouts(model)
    before = KERNELS["te_thd"]
    with torch.no_grad():
        packed = model(ids, doc_ids=doc_ids).float()
        thd_calls, count = list(seen), KERNELS["te_thd"] - before
        host = model(ids, doc_ids=doc_ids, cu_seqlens=cu_seqlens(doc_ids.cpu())).float()  # the loader's
        plain = model(ids).float()
        for hook in hooks:
            hook.remove()
        errors, crossed = [], []
        for b, row in enumerate(DOCS):
            start = 0
            for n in row:  # TE's THD RoPE restarts positions per document: the document alone from 0
                alone = model(ids[b:b + 1, start:start + n])[0].float()
                errors.append((packed[b, start:start + n] - alone).abs().max().item())
                if start:
                    crossed.append((plain[b, start:start + n] - alone).abs().max().item())
                start += n
    assert count == layers, count
    # TE's own record: with doc_ids each layer's attention ran THD over all B * T tokens (4 query heads
    # of 32), without them the built bshd layout
    assert thd_calls == [("thd", (len(DOCS) * T, 4, 32))] * layers, thd_calls
    assert seen == thd_calls * 2 + [("bshd", (len(DOCS), T, 4, 32))] * layers, seen
    scale = packed.abs().max().item()
    print(f"te_gpt THD: per-document max |packed - alone| {max(errors):.2e}, without the mask "
          f"{min(crossed):.2e} (logits up to {scale:.2f})")
    assert max(errors) <= 0.05 * scale, errors  # bf16 through different attention kernels (THD vs bshd)
    assert min(crossed) > 4 * max(errors), (crossed, errors)  # the mask is what makes them equal
    torch.testing.assert_close(host, packed, rtol=0, atol=0.01 * scale)


def test_te_gpt_doc_mask_no_gradient_crosses_a_document():
    require_gpus(1)
    require_te()
    import torch
    import torch.nn.functional as F

    from mfsdp_launch.models.doc_attention import KERNELS

    model = _te_gpt_bf16()
    ids, doc_ids = _packed_batch()
    captured = {}

    def leaf(module, args, out):  # the input embeddings, as a leaf that keeps its gradient
        captured["emb"] = out.detach().requires_grad_(True)
        return captured["emb"]

    hook = model.tok_emb.register_forward_hook(leaf)
    before = KERNELS["te_thd"]
    logits = model(ids, doc_ids=doc_ids)
    hook.remove()
    assert KERNELS["te_thd"] - before == len(model.layers)
    a, b = DOCS[0][0], DOCS[0][0] + DOCS[0][1]  # document 2 of row 0
    F.cross_entropy(logits[0, a:b - 1].float(), ids[0, a + 1:b]).backward()
    grad = captured["emb"].grad
    assert torch.count_nonzero(grad[0, :a]) == 0  # document 1: exactly zero
    assert torch.count_nonzero(grad[0, b:]) == 0 and torch.count_nonzero(grad[1]) == 0  # document 3, row 1
    assert (grad[0, a:b - 1].abs().sum(-1) > 0).all()  # every token of document 2 reaches the loss


def _te_packed_cli(name: str, *extra: str) -> list:
    """Six steps of a tiny bf16 te_gpt on packed documents through the CLI; the loss of each."""
    from test_sft_gpu import _cli, _corpus

    rows = _cli(name, "model=te_gpt", "model.preset=tiny", "model.dim=128", "model.n_layers=2", "model.n_heads=4",
                "model.n_kv_heads=2", "model.ffn_dim=256", "model.vocab_size=256", "precision.compute_dtype=bf16",
                "precision.main_params_dtype=fp32", "data=tokens", f"data.sources=[{{path: '{_corpus()}'}}]",
                "data.pack=documents", "train.seq_len=256", "train.micro_batch_size=2", "train.steps=6",
                "optim.lr=3e-3", "optim.warmup_steps=0", *extra)
    return [r["loss"] for r in rows]


@pytest.mark.parametrize("extra", [["engine=megatron_fsdp", "model.activation_checkpointing=full"],
                                   ["engine=megatron_fsdp"], ["engine=fsdp2"]])
def test_te_gpt_doc_mask_trains_through_the_cli(extra):
    """data.pack=documents data.doc_mask=true on te_gpt trains under both engines (under
    activation checkpointing the recompute runs THD too)."""
    require_gpus(1)
    require_te()
    losses = _te_packed_cli(f"te_docs_{'_'.join(e.split('=')[-1] for e in extra)}", "data.doc_mask=true", *extra)
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses


def test_te_gpt_trains_under_fsdp2():
    """te_gpt under engine=fsdp2 without document masks. Its attention proj te.Linear is an FSDP2
    unit inside its layer's unit: wrapped top-down, the proj weight reached TE's GEMM as a DTensor
    with a null data pointer (session 19's cuBLAS error; engines/fsdp2.py now wraps bottom-up)."""
    require_gpus(1)
    require_te()
    losses = _te_packed_cli("te_fsdp2_plain", "engine=fsdp2")
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses


@uses("te_ga2", "te_ga2_wgrad")
def test_te_cli_wgrad_fusion_follows_unfused_losses(request, te_gpu):
    ref = G.get(request, "te_ga2").ok().losses()
    got = G.get(request, "te_ga2_wgrad").ok().losses()
    assert_learns(got, STEPS, min_drop=0.5, what="fused wgrad")
    assert_close(got, ref, range(1, STEPS + 1), rel=1e-2, what="fuse_wgrad_accumulation vs unfused")
