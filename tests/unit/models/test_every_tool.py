"""Every family gets the memory and parallelism tools (issue 26), trained through the product's own
wiring (planner.prepare -> rank/runtime.build_training -> the engine's step check, the checkpoint
manager, mfsdp-export), in this process or in gloo ranks:

* activation checkpointing of `model=hf`'s decoder layers and `model=custom`'s unit modules under
  FSDP2 gives the losses of no checkpointing while the saved activations shrink (one rank);
* `model=hf` with mesh.tp=2 (the architecture's TP plan + sequence parallelism) and with
  mesh.cp=2 (all-gather attention) on 4 ranks give the losses of tp=cp=1; a tp=2 checkpoint
  resumes at tp=1 with the same losses, and its HF export holds whole tensors (one run_ranks)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers import USER_MODULE_NAME, one_rank_group, run_ranks, write_user_module  # noqa: E402

TINY_LLAMA = ("model=hf", "model.hf_class=LlamaForCausalLM",
              "model.hf_config={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 4, "
              "num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 256, max_position_embeddings: 64}")
# The README's module (helpers.USER_MODULE), four blocks.
README_CUSTOM = ("model=custom", f"model.target={USER_MODULE_NAME}:build", "model.kwargs={n_layers: 4}",
                 f"model.fsdp_unit_modules=[{USER_MODULE_NAME}.Block]")
COMMON = ("engine=fsdp2", "data=synthetic", "train.seq_len=32", "train.micro_batch_size=2", "optim.lr=1e-2",
          "optim.warmup_steps=0", "precision.compute_dtype=fp32", "launcher.nproc_per_node=1")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny matmuls on a shared 2-core machine: one intra-op thread is several times faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def train_here(overrides, steps: int, *, world: int = 1, run_dir=None, save_at=None):
    """(losses per step, saved-activation bytes of the first forward, Training) of the product's
    training wiring on this process's (initialized) group. With `run_dir` the checkpoint manager
    resumes from it first (losses start after the resumed step) and saves at step `save_at`."""
    import torch.distributed as dist

    from mfsdp_launch.mesh import ParallelDims
    from mfsdp_launch.planner import prepare
    from mfsdp_launch.rank.loop import TrainState
    from mfsdp_launch.rank.runtime import Runtime, batch_source, build_checkpoints, build_training

    where = [f"run.dir={run_dir}", "checkpoint.interval_minutes=null"] if run_dir else []
    cfg, _ = prepare([*COMMON, *overrides, *where, f"launcher.nproc_per_node={world}"], check_hardware=False)
    dims = ParallelDims.from_config(cfg.mesh, world)
    rt = Runtime(rank=dist.get_rank(), local_rank=0, world_size=world, device=torch.device("cpu"),
                 control=dist.group.WORLD, dims=dims, mesh=dims.build("cpu"))
    tr = build_training(cfg, rt)
    state, mgr = TrainState(), build_checkpoints(cfg, rt, tr.engine) if run_dir else None
    if mgr is not None:
        mgr.resume(tr.model, tr.optimizer, tr.scheduler, state)
    next_batch = batch_source(cfg, tr.spec, rt, state)
    saved, losses = [], []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    per_step = cfg.train.micro_batch_size * dims.dp_size
    while state.step < steps:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if not losses else nullcontext():
            loss = tr.spec.loss(tr.forward_model, next_batch(state.step, 0))
        loss.backward()
        check = tr.engine.check_step(tr.model, cfg.train.grad_clip, loss)
        tr.optimizer.step()
        tr.scheduler.step()
        tr.optimizer.zero_grad(set_to_none=True)
        losses.append(check.loss)
        state.step += 1
        state.consumed_samples += per_step
        state.tokens_seen += per_step * cfg.train.seq_len
        if state.step == save_at:
            mgr.maybe_save(state.step, tr.model, tr.optimizer, tr.scheduler, state, force=True)
            mgr.wait()
    return losses, sum(saved), tr


@pytest.mark.parametrize("model", ["hf", "custom"])
def test_checkpointing_hf_and_custom_keeps_the_losses_and_shrinks_saved_activations(tmp_path, monkeypatch, model):
    write_user_module(tmp_path / "mod")
    monkeypatch.syspath_prepend(str(tmp_path / "mod"))
    overrides = TINY_LLAMA if model == "hf" else README_CUSTOM
    runs = {}
    with one_rank_group(tmp_path / "store"):
        for mode in ("none", "full", "selective"):
            runs[mode] = train_here([*overrides, f"model.activation_checkpointing={mode}", "model.ac_every=2"], 4)
    none, full, sel = (runs[k] for k in ("none", "full", "selective"))
    assert len(set(none[0])) == 4  # the weights move
    for other in (full, sel):
        assert other[0] == pytest.approx(none[0], rel=1e-5, abs=1e-6)
    # 4 units: selective (every 2nd) checkpoints 2, full all 4; the logits stay in every mode.
    assert full[1] < sel[1] < none[1], (none[1], sel[1], full[1])
    assert none[1] - full[1] > 1.5 * (none[1] - sel[1])


# ---------------------------------------------------------------- model=hf: tp=2, cp=2, reshard

TP_LLAMA = ("model=hf", "model.hf_class=LlamaForCausalLM",
            "model.hf_config={hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, "
            "num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 256, max_position_embeddings: 64}",
            "optim.decay_steps=20", "optim.lr=3e-3")


def _parallel_child(rank: int, world: int, tmp: str) -> None:
    """4 ranks: tp=1 x dp=4 (mbs 2) is the reference; tp=2 x dp=2 and cp=2 x dp=2 (mbs 4) see the
    same 8 samples per step. The tp=2 run saves at step 10; tp=1 resumes it to step 20."""
    from pathlib import Path

    import torch.distributed as dist

    torch.set_num_threads(1)
    one = train_here([*TP_LLAMA, "train.micro_batch_size=2"], 20, world=world)[0]
    run = Path(tmp) / "tp2"
    tp2, _, tr = train_here([*TP_LLAMA, "mesh.tp=2", "train.micro_batch_size=4"], 20, world=world, run_dir=run,
                            save_at=10)
    assert len(set(one)) == 20, one  # the weights move
    assert tp2 == pytest.approx(one, rel=1e-5), (one, tp2)
    resumed = train_here([*TP_LLAMA, "train.micro_batch_size=2"], 20, world=world, run_dir=run)[0]
    assert resumed == pytest.approx(one[10:], rel=1e-5), (one[10:], resumed)
    cp2 = train_here([*TP_LLAMA, "mesh.cp=2", "train.micro_batch_size=4"], 10, world=world)[0]
    assert cp2 == pytest.approx(one[:10], rel=1e-5), (one[:10], cp2)
    if rank == 0:  # the tp=2 checkpoint's HF export: whole tensors, loadable by transformers
        from mfsdp_launch.tools.export import export

        export(run / "checkpoints" / "step_10", Path(tmp) / "hf", fmt="hf")
    dist.barrier()


@pytest.mark.slow
def test_hf_tp2_and_cp2_match_tp1_and_a_tp2_checkpoint_resumes_at_tp1(tmp_path):
    from transformers import AutoModelForCausalLM

    from mfsdp_launch.models.hf import model as H

    run_ranks(_parallel_child, 4, str(tmp_path), timeout=600)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    fields = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    plain = H.build_hf_model(H.resolve_hf_model(hf_config=fields, hf_class="LlamaForCausalLM"))
    assert {k: v.shape for k, v in exported.state_dict().items()} == {k: v.shape for k, v in plain.state_dict().items()}


def _hf(model_type: str, **fields) -> str:
    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    if model_type == "gpt2":
        base = dict(n_embd=32, n_layer=1, n_head=4, vocab_size=256, n_positions=64)
    body = ", ".join(f"{k}: {v}" for k, v in {**base, **fields}.items())
    return f"model.hf_config={{model_type: {model_type}, {body}}}"


@pytest.mark.parametrize("overrides,key,words", [
    ([_hf("gpt2"), "mesh.tp=2"], "mesh.tp", "GPT2LMHeadModel (model_type 'gpt2') has no tensor-parallel plan"),
    # transformers 4.x plans Mixtral's experts with a style we do not apply (moe_tp_experts); 5.x leaves
        # the MoE block out of the plan: either way the architecture is named and refused.
        ([_hf("mixtral", num_local_experts=2), "mesh.tp=2"], "mesh.tp", "MixtralForCausalLM (model_type 'mixtral') has"),
    ([_hf("llama", num_key_value_heads=1), "mesh.tp=2"], "mesh.tp", "does not divide the 1 key/value heads"),
    ([_hf("llama"), "mesh.tp=2", "engine=megatron_fsdp"], "mesh.tp", "model=hf's DTensor tensor parallelism"),
    ([_hf("mistral", sliding_window=16), "mesh.cp=2"], "mesh.cp", "sliding-window attention (16 tokens)"),
])
def test_hf_parallelism_refusals_are_one_line(overrides, key, words):
    from helpers import refused

    exc = refused("model=hf", *overrides, "launcher.nproc_per_node=2", "launcher.dry_run=true")
    assert exc.key == key and words in str(exc) and "\n" not in str(exc), str(exc)


@pytest.mark.parametrize("model", ["hf", "custom"])
def test_the_memory_estimate_follows_the_mode(tmp_path, monkeypatch, model):
    from helpers import model_cfg
    from mfsdp_launch.models import family

    write_user_module(tmp_path / "mod")
    monkeypatch.syspath_prepend(str(tmp_path / "mod"))
    fields = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256)
    keys = (dict(hf_class="LlamaForCausalLM", hf_config=fields) if model == "hf" else
            dict(target=f"{USER_MODULE_NAME}:build", kwargs={"n_layers": 4},
                 fsdp_unit_modules=[f"{USER_MODULE_NAME}.Block"]))

    def act(mode, every=2):
        m = model_cfg(model, activation_checkpointing=mode, ac_every=every, **keys)
        return family(model).activation_bytes(m, 4, 1024, 2)

    assert act("full") < act("selective", 2) < act("selective", 4) < act("none")


# ---------------------------------------------------------------- model.loss_kernel=chunked (model=hf)


def test_chunked_cross_entropy_equals_the_plain_loss_and_its_gradients():
    import torch.nn.functional as F

    from mfsdp_launch.models.chunked_loss import cross_entropy_sum
    from mfsdp_launch.models.losses import IGNORE_INDEX

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 10, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(50, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (3, 10), generator=g)
    labels[0, :7] = IGNORE_INDEX  # a chunk (of 4) without any target, and ragged ones
    labels[2, 3] = IGNORE_INDEX
    plain = F.cross_entropy(F.linear(hidden, weight, bias).flatten(0, 1), labels.flatten(), reduction="sum",
                            ignore_index=IGNORE_INDEX)
    ref = torch.autograd.grad(plain, (hidden, weight, bias))
    got = cross_entropy_sum(hidden, weight, bias, labels, chunk=4)
    assert got.dtype == torch.float32  # the loss in fp32, as the plain loss
    grads = torch.autograd.grad(got, (hidden, weight, bias))
    assert got.item() == pytest.approx(plain.item(), rel=1e-6)
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_hf_chunked_loss_keeps_the_losses_under_fsdp2(tmp_path, monkeypatch):
    from mfsdp_launch.models import chunked_loss

    monkeypatch.setattr(chunked_loss, "CHUNK_LOGITS", 256 * 16)  # 16 tokens a chunk: 4 per micro-batch
    runs = {}
    with one_rank_group(tmp_path / "store"):
        for kernel in ("torch", "chunked"):
            runs[kernel] = train_here([*TINY_LLAMA, f"model.loss_kernel={kernel}"], 4)
    plain, (chunked, _, tr) = runs["torch"][0], runs["chunked"]
    assert len(set(plain)) == 4  # the weights move
    assert chunked == pytest.approx(plain, rel=1e-6), (plain, chunked)
    ids = torch.zeros((1, 8), dtype=torch.long)  # outside the loss the head gives logits, as before
    assert tr.model(ids).logits.shape == (1, 8, 256)


def test_the_chunked_head_saves_no_logits_for_backward(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from mfsdp_launch.models import chunked_loss
    from mfsdp_launch.models.losses import hf_logits, hf_loss

    monkeypatch.setattr(chunked_loss, "CHUNK_LOGITS", 256 * 16)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}

    def saved_shapes(model, loss):
        shapes = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
            loss(model, batch)
        return shapes

    torch.manual_seed(0)
    plain = saved_shapes(LlamaForCausalLM(config), hf_loss)
    chunked = saved_shapes(chunked_loss.install(LlamaForCausalLM(config)), chunked_loss.chunked(hf_logits))
    assert (64, 256) in plain  # the log-softmax of every token's logits
    assert not [s for s in chunked if s and s[-1] == 256], chunked  # the chunks' logits are recomputed in backward


@pytest.mark.parametrize("overrides,words", [
    (["model=gpt", "model.loss_kernel=chunked"], "chunked is model=hf's; model=gpt has te_fused"),
    (["model=hf", _hf("llama"), "model.loss_kernel=te_fused"], "te_fused is the Llama family's"),
    (["model=hf", _hf("llama"), "model.loss_kernel=chunked", "mesh.tp=2"], "chunked with mesh.tp=2 is not wired"),
    (["model=hf", _hf("gemma3_text", head_dim=8, final_logit_softcapping=30.0), "model.loss_kernel=chunked"],
     "Gemma3ForCausalLM it soft-caps its logits (final_logit_softcapping=30.0)"),
])
def test_chunked_loss_refusals_are_one_line(overrides, words):
    from helpers import refused

    exc = refused(*overrides, "launcher.nproc_per_node=2", "launcher.dry_run=true")
    assert exc.key == "model.loss_kernel" and words in str(exc) and "\n" not in str(exc), str(exc)


def test_the_memory_estimate_knows_the_chunked_loss():
    from helpers import model_cfg
    from mfsdp_launch.models import family

    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128256)

    def act(kernel):
        m = model_cfg("hf", hf_class="LlamaForCausalLM", hf_config=fields, loss_kernel=kernel)
        return family("hf").activation_bytes(m, 4, 8192, 2)

    # 32k tokens x 128k vocabulary: the plain loss's 6 bytes a logit (25 GB) against one chunk's 1.9 GB
    assert act("torch") - act("chunked") > 20e9, (act("torch"), act("chunked"))


def test_the_memory_estimate_prices_hf_logits_as_gpts():
    """The logits are a line of their own, priced by gpt's rule: train.compile's cross-entropy keeps
    6 bytes a logit (the old count, 14, put the 8B HF slice at 72.6 GiB against 59.6 measured);
    the plain loss its 12 fp32 bytes and the model's bf16 logits."""
    from helpers import model_cfg
    from mfsdp_launch.models import family
    from mfsdp_launch.models.llama.dims import COMPILED_LOSS_BYTES_PER_LOGIT, LOSS_BYTES_PER_LOGIT

    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=128256)
    m = model_cfg("hf", hf_class="LlamaForCausalLM", hf_config=fields)
    logits = 8192 * 128256
    compiled = family("hf").activation_parts(m, 1, 8192, 2, compiled=True)
    plain = family("hf").activation_parts(m, 1, 8192, 2)
    assert compiled["logits"] == logits * COMPILED_LOSS_BYTES_PER_LOGIT
    assert plain["logits"] == logits * (LOSS_BYTES_PER_LOGIT + 2)
    assert compiled["activations"] == plain["activations"] < logits  # the head's output left to the logits line
