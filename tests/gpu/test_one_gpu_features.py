"""One GPU, through the CLI (`python -m mfsdp_launch ...`, `mfsdp-export ...`), both engines:
training (loss falls, metrics and checkpoints written), checkpoint + resume (the resumed steps
give the uninterrupted run's losses), the ZeRO levels and the two engines (the same losses at
dp=1), activation checkpointing full/selective and train.compile (the losses of the plain run),
frozen parameters (unchanged across steps), precision dtypes (main params/grads, grad_comm),
the one-line out-of-memory report (exit code 1), train.profile (a CUDA trace per rank), and
Hugging Face interop (model=hf from a tiny Llama directory this test writes with transformers,
trained from its pretrained weights; `mfsdp-export --format hf` of model=hf and of gpt loads in
transformers and gives the trainer's loss and the plain export's logits).

Every run trains a tiny model on a one-window corpus (_one_gpu.window_file): every sample is
the same text, so the loss falls fast and a checkpoint's loss on that text is the loss the
trainer logs at the next step. The runs start in the background, several at a time
(_one_gpu.py); each test reads the runs it names in @uses.
"""

from __future__ import annotations

import gzip
import json
import math
import textwrap

import pytest

import _one_gpu as G
from _harness import OOM_MODULE, require_gpus
from _one_gpu import Result, assert_close, assert_learns, uses

pytestmark = pytest.mark.gpu

SEQ = 64
ENGINES = ["megatron_fsdp", "fsdp2"]
GPT = ["model=gpt", "model.preset=tiny", "data=text", f"data.path={G.window_file(SEQ)}", f"train.seq_len={SEQ}",
       "train.micro_batch_size=4", "train.log_interval=1", "train.progress=false", "optim.lr=3e-3",
       "optim.warmup_steps=0", "optim.decay_steps=50", "precision.compute_dtype=fp32",
       "precision.main_params_dtype=fp32"]
SHORT = ["train.steps=3", "checkpoint.save_final=false"]
ZERO_LEVELS = {"megatron_fsdp": [0, 1, 2], "fsdp2": [0, 2]}  # against the A runs' 3 (optim_grads_params)
AC_MODES = ["full", "selective"]
DTYPES = {  # name -> overrides (megatron_fsdp), relative bound against the fp32 run's losses
    "bf16-comm": (["precision.compute_dtype=bf16", "precision.main_grads_dtype=fp32",
                   "precision.grad_comm_dtype=bf16"], 0.05),
    "bf16-grads": (["precision.compute_dtype=bf16", "precision.main_grads_dtype=bf16"], 0.05),
    "bf16-no-main-params": (["precision.compute_dtype=bf16", "precision.main_params_dtype=null"], 0.1),
    "fp64-main": (["precision.main_params_dtype=fp64", "precision.main_grads_dtype=fp32"], 1e-4),
}
# A product bug seen on one H200 (2026-12-01): Megatron-FSDP's clip_grad_norm (engines/megatron.py
# _square_norm) calls torch._foreach_norm(grads, 2.0, dtype=torch.float32) on fp64 gradients at step 1.
FREEZE = "layers.0.*"
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256)


def short(e: str) -> str:
    return {"megatron_fsdp": "meg", "fsdp2": "fsdp2"}[e]


def ckpt(run: str, step: int):
    return str(G.RUNS_DIR / run / "checkpoints" / f"step_{step}")


def _llama_dir():
    return G.BASE_DIR / "llama_tiny"


def _write_llama(run) -> None:
    """A tiny Llama directory (config.json + model.safetensors), written once per session."""
    d = _llama_dir()
    if (d / "config.json").is_file():
        return
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA)).save_pretrained(d)


def _write_oom_module(run) -> None:
    d = G.BASE_DIR / "oom_module"
    d.mkdir(parents=True, exist_ok=True)
    (d / "oom_gpu_model.py").write_text(textwrap.dedent(OOM_MODULE))


# ------------------------------------------------------------------------------- the runs

for _e in ENGINES:
    _s = short(_e)
    _eng = f"engine={_e}"
    G.train(f"{_s}_a", *GPT, _eng, "train.steps=6", "checkpoint.interval=3", priority=0)
    G.train(f"{_s}_c", *GPT, _eng, "train.steps=6", "checkpoint.interval=3", after=[f"{_s}_a"],
            prepare=G.copy_checkpoint(f"{_s}_a", 3), priority=0)
    for _z in ZERO_LEVELS[_e]:
        G.train(f"{_s}_zero{_z}", *GPT, _eng, *SHORT, f"sharding.zero_dp_strategy={_z}")
    for _mode in AC_MODES:
        G.train(f"{_s}_ac_{_mode}", *GPT, _eng, *SHORT, f"model.activation_checkpointing={_mode}")
    G.train(f"{_s}_freeze", *GPT, _eng, "train.steps=3", "checkpoint.interval=1", f"model.freeze=[{FREEZE}]")
    for _step in (1, 3):
        G.command(f"{_s}_freeze_export{_step}", "mfsdp-export", ckpt(f"{_s}_freeze", _step),
                  str(G.BASE_DIR / "exports" / f"{_s}_freeze_step{_step}.pt"), "--format", "torch",
                  after=[f"{_s}_freeze"])
    G.train(f"{_s}_profile", *GPT, _eng, "train.steps=4", "checkpoint.save_final=false", "train.profile.start=2",
            "train.profile.steps=2")
    G.train(f"{_s}_oom", _eng, "model=custom", "model.target=oom_gpu_model:LM",
            "model.fsdp_unit_modules=[oom_gpu_model.Block]", "data=synthetic", "train.steps=6", "train.log_interval=1",
            "train.progress=false", "train.seq_len=64", "train.micro_batch_size=2", "precision.compute_dtype=bf16",
            "checkpoint.save_final=false", prepare=_write_oom_module,
            env={"PYTHONPATH": str(G.BASE_DIR / "oom_module")})
    G.train(f"{_s}_hf", *GPT[2:], _eng, "model=hf", f"model.path={_llama_dir()}", "model.pretrained=true",
            "train.steps=3", "checkpoint.interval=2", prepare=_write_llama, priority=0)
    G.command(f"{_s}_hf_export_hf", "mfsdp-export", ckpt(f"{_s}_hf", 2), str(G.BASE_DIR / "exports" / f"{_s}_hf_hf"),
              "--format", "hf", after=[f"{_s}_hf"])
    G.command(f"{_s}_hf_export_st", "mfsdp-export", ckpt(f"{_s}_hf", 2),
              str(G.BASE_DIR / "exports" / f"{_s}_hf.safetensors"), "--format", "safetensors", after=[f"{_s}_hf"])
    G.command(f"{_s}_gpt_export_hf", "mfsdp-export", ckpt(f"{_s}_a", 3), str(G.BASE_DIR / "exports" / f"{_s}_gpt_hf"),
              "--format", "hf", after=[f"{_s}_a"])
G.train("meg_compile", *GPT, "engine=megatron_fsdp", *SHORT, "train.compile=true", timeout=480, priority=0)
for _name, (_over, _) in DTYPES.items():
    G.train(f"meg_dtype_{_name}", *GPT, "engine=megatron_fsdp", "train.steps=6", "checkpoint.save_final=false", *_over)


@pytest.fixture(autouse=True)
def _one_gpu(request):
    require_gpus(1)


def window_batch(seq: int = SEQ):
    import torch

    ids = torch.tensor(list(G.window_bytes(seq)), dtype=torch.long)[None]
    return ids[:, :-1], ids[:, 1:]


def hf_loss_and_logits(model):
    import torch
    import torch.nn.functional as F

    inputs, labels = window_batch()
    with torch.no_grad():
        logits = model(inputs).logits.float()
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten()).item(), logits


def load_hf(path):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# ------------------------------------------------------------------------------- training + resume


@pytest.mark.parametrize("engine", ENGINES)
@uses(lambda p: [f"{short(p['engine'])}_a"])
def test_cli_trains_and_checkpoints(request, engine):
    r = G.get(request, f"{short(engine)}_a").ok()
    assert_learns(r.losses(), 6, min_drop=0.5, what=engine)
    cfg = r.config()
    assert cfg.engine.name == engine and cfg.launcher.nproc_per_node == 1 and cfg.mesh.dp_shard == 1, cfg.mesh
    for row in r.rows():
        assert row["tokens_per_s_per_gpu"] > 0 and row["peak_mem_gib"] > 0, row
        assert row["mfu"] is not None and 0 < row["mfu"] < 1, row  # the GPU's peak is known (H200)
    for step in (3, 6):
        assert (r.run_dir / "checkpoints" / f"step_{step}" / "manifest.json").is_file(), step
    assert "exit code 0" in r.stdout, r.tail()


@pytest.mark.parametrize("engine", ENGINES)
@uses(lambda p: [f"{short(p['engine'])}_a", f"{short(p['engine'])}_c"])
def test_cli_resume_continues_the_uninterrupted_losses(request, engine):
    """A run dir holding only the other run's step_3 resumes there (model, optimizer, LR schedule
    and data position) and logs steps 4-6 with the uninterrupted run's losses."""
    s = short(engine)
    a = G.get(request, f"{s}_a").ok().losses()
    r = G.get(request, f"{s}_c").ok()
    assert "resuming from step 3" in r.stdout, r.tail()
    got = r.losses()
    assert sorted(got) == [4, 5, 6], sorted(got)
    assert_close(got, a, range(4, 7), rel=1e-5, what=f"{engine} resumed vs uninterrupted")


@uses("meg_a", "fsdp2_a")
def test_cli_megatron_fsdp_and_fsdp2_give_the_same_losses(request):
    """Same seed, model, data and AdamW at dp=1 in fp32: the two engines train the same curve."""
    meg = G.get(request, "meg_a").ok().losses()
    fsdp = G.get(request, "fsdp2_a").ok().losses()
    assert_close(meg, fsdp, [1], rel=1e-5, what="step 1 (the same initial weights)")
    assert_close(meg, fsdp, range(1, 7), rel=1e-3, what="megatron_fsdp vs fsdp2")


@pytest.mark.parametrize("engine,zero", [(e, z) for e in ENGINES for z in ZERO_LEVELS[e]])
@uses(lambda p: [f"{short(p['engine'])}_a", f"{short(p['engine'])}_zero{p['zero']}"])
def test_cli_zero_levels_give_the_same_losses(request, engine, zero):
    """sharding.zero_dp_strategy=0..2 at dp_shard=1 trains exactly as ZeRO-3 does."""
    s = short(engine)
    ref = G.get(request, f"{s}_a").ok().losses()
    r = G.get(request, f"{s}_zero{zero}").ok()
    names = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
    assert r.config().sharding.zero_dp_strategy == names[zero], r.config().sharding
    assert_close(r.losses(), ref, range(1, 4), rel=1e-4, what=f"{engine} zero {zero} vs 3")


@pytest.mark.parametrize("mode", AC_MODES)
@pytest.mark.parametrize("engine", ENGINES)
@uses(lambda p: [f"{short(p['engine'])}_a", f"{short(p['engine'])}_ac_{p['mode']}"])
def test_cli_activation_checkpointing_keeps_the_losses(request, engine, mode):
    s = short(engine)
    ref = G.get(request, f"{s}_a").ok().losses()
    r = G.get(request, f"{s}_ac_{mode}").ok()
    assert str(r.config().model.activation_checkpointing) == mode
    assert_close(r.losses(), ref, range(1, 4), rel=1e-5, what=f"{engine} activation_checkpointing={mode}")


@uses("meg_a", "meg_compile")
def test_cli_compile_keeps_the_losses(request):
    """train.compile=true (each block compiled) under Megatron-FSDP: the eager run's losses up to
    the fused kernels' rounding."""
    ref = G.get(request, "meg_a").ok().losses()
    r = G.get(request, "meg_compile").ok()
    assert r.config().train.compile is True
    assert_close(r.losses(), ref, range(1, 4), rel=1e-3, what="compiled vs eager")


# ------------------------------------------------------------------------------- freeze, dtypes


@pytest.mark.parametrize("engine", ENGINES)
@uses(lambda p: [f"{short(p['engine'])}_freeze", f"{short(p['engine'])}_freeze_export1",
                 f"{short(p['engine'])}_freeze_export3"])
def test_cli_frozen_params_stay_unchanged(request, engine):
    import fnmatch

    import torch

    s = short(engine)
    r = G.get(request, f"{s}_freeze").ok()
    assert "frozen tensors)" in r.stdout, r.tail()
    assert_learns(r.losses(), 3, min_drop=0.1, what="frozen run")
    for step in (1, 3):
        G.get(request, f"{s}_freeze_export{step}").ok()
    w1 = torch.load(G.BASE_DIR / "exports" / f"{s}_freeze_step1.pt")
    w3 = torch.load(G.BASE_DIR / "exports" / f"{s}_freeze_step3.pt")
    assert w1.keys() == w3.keys()
    frozen = [k for k in w1 if fnmatch.fnmatchcase(k, FREEZE)]
    trained = [k for k in w1 if k not in frozen]
    assert frozen and trained, sorted(w1)
    assert all(torch.equal(w1[k], w3[k]) for k in frozen), [k for k in frozen if not torch.equal(w1[k], w3[k])]
    changed = [k for k in trained if not torch.equal(w1[k], w3[k])]
    assert len(changed) == len(trained), sorted(set(trained) - set(changed))


@pytest.mark.parametrize("name", list(DTYPES))
@uses(lambda p: ["meg_a", f"meg_dtype_{p['name']}"])
def test_cli_precision_dtypes_train(request, name):
    """precision.* variants under Megatron-FSDP: the frozen config has them, the run learns and
    follows the fp32 run's curve (fp64 main weights: to 1e-4)."""
    overrides, rel = DTYPES[name]
    ref = G.get(request, "meg_a").ok().losses()
    r = G.get(request, f"meg_dtype_{name}").ok()
    pc = r.config().precision
    for o in overrides:
        key, value = o.split("=")
        got = pc[key.split(".")[1]]
        assert (got is None if value == "null" else str(got) == value), (key, got)
    assert_learns(r.losses(), 6, min_drop=0.5, what=name)
    assert_close(r.losses(), ref, range(1, 7), rel=rel, what=f"{name} vs fp32")


# ------------------------------------------------------------------------------- OOM, profile


@pytest.mark.parametrize("engine", ENGINES)
@uses(lambda p: [f"{short(p['engine'])}_oom"])
def test_cli_real_cuda_oom_is_one_line(request, engine):
    """A custom model that asks for ~9 TiB at its third forward: the console shows oom.py's one
    line (step, measured peak, the GPU's total, the hint), no traceback, exit code 1."""
    r = G.get(request, f"{short(engine)}_oom")
    assert r.error is None, r.error
    console = r.console
    assert r.rc == 1, r.tail()
    lines = [x for x in console.splitlines() if "ran out of GPU memory at step 3" in x]
    assert len(lines) == 1, r.tail()
    assert "ran out of GPU memory" in console.strip().splitlines()[-1], r.tail()  # the summary's "why"
    assert "GiB reserved, of the GPU's" in lines[0] and "model.activation_checkpointing=full" in lines[0], lines
    assert "Traceback" not in console, r.tail()
    assert [row["step"] for row in r.rows()] == [1, 2], r.rows()


@pytest.mark.parametrize("engine", ENGINES)
@uses(lambda p: [f"{short(p['engine'])}_profile"])
def test_cli_profile_writes_a_cuda_trace_and_the_top_ops(request, engine):
    r = G.get(request, f"{short(engine)}_profile").ok()
    with gzip.open(r.run_dir / "profile" / "trace_rank0.json.gz", "rt") as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events), "no CUDA kernel in the trace"
    table = (r.run_dir / "profile" / "top_ops.txt").read_text()
    assert "by self device (GPU) time, steps 2-3, rank 0" in table and "Self CUDA" in table, table
    assert table.splitlines()[0] in r.stdout
    assert sorted(r.losses()) == [1, 2, 3, 4]


# ------------------------------------------------------------------------------- Hugging Face


@pytest.mark.parametrize("engine", ENGINES)
@uses(lambda p: [f"{short(p['engine'])}_hf", f"{short(p['engine'])}_hf_export_hf",
                 f"{short(p['engine'])}_hf_export_st"])
def test_cli_hf_llama_trains_from_its_weights_and_exports(request, engine):
    """model=hf model.pretrained=true: the first loss is the pretrained model's on the window;
    `mfsdp-export --format hf` of step 2 loads in transformers, gives the trainer's step-3 loss,
    and the plain safetensors export's logits."""
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    import torch
    import transformers
    from safetensors.torch import load_file

    s = short(engine)
    r = G.get(request, f"{s}_hf").ok()
    assert "model.pretrained: loaded" in r.stdout and "model hf:" in r.stdout, r.tail()
    losses = assert_learns(r.losses(), 3, min_drop=0.05, what="model=hf")
    pre_loss, _ = hf_loss_and_logits(load_hf(_llama_dir()))
    assert losses[0] == pytest.approx(pre_loss, rel=1e-4), (losses, pre_loss)

    G.get(request, f"{s}_hf_export_hf").ok()
    out = G.BASE_DIR / "exports" / f"{s}_hf_hf"
    exported = load_hf(out)
    assert type(exported).__name__ == "LlamaForCausalLM"
    loss2, logits = hf_loss_and_logits(exported)
    assert loss2 == pytest.approx(losses[2], rel=1e-4), (loss2, losses)  # step 3's loss = step 2's weights

    G.get(request, f"{s}_hf_export_st").ok()
    plain = load_file(str(G.BASE_DIR / "exports" / f"{s}_hf.safetensors"))
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_LLAMA)).eval()
    model.load_state_dict(plain, strict=True)
    _, plain_logits = hf_loss_and_logits(model)
    assert torch.equal(logits, plain_logits)
    assert not torch.equal(plain["lm_head.weight"], load_hf(_llama_dir()).state_dict()["lm_head.weight"])


@pytest.mark.parametrize("engine", ENGINES)
@uses(lambda p: [f"{short(p['engine'])}_a", f"{short(p['engine'])}_gpt_export_hf"])
def test_cli_gpt_exports_to_hf_with_the_trainer_loss(request, engine):
    """`mfsdp-export CKPT OUT --format hf` of a built-in gpt checkpoint: a Llama directory whose
    logits in transformers give the loss the trainer logged at the next step."""
    pytest.importorskip("transformers")
    s = short(engine)
    losses = G.get(request, f"{s}_a").ok().losses()
    G.get(request, f"{s}_gpt_export_hf").ok()
    out = G.BASE_DIR / "exports" / f"{s}_gpt_hf"
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_size"] == 64, config
    loss, logits = hf_loss_and_logits(load_hf(out))
    assert math.isfinite(loss) and logits.shape[-1] == 256
    assert loss == pytest.approx(losses[4], rel=1e-4), (loss, losses)
