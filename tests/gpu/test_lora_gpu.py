"""LoRA on one GPU (model.peft, models/lora.py): under engine=megatron_fsdp the frozen bf16 base
uses Megatron-FSDP's frozen-parameter support (no main weights or gradient buffer for it), the
fp32 adapters train, their checkpoint resumes to the same losses, Megatron-FSDP's meta-device init
starts the adapters at B = 0 (the first loss is the base model's, as without meta init and as
under FSDP2), `model=hf` trains through peft too, the merged export loads in transformers, and
QLoRA trains over an NF4 base."""

from __future__ import annotations

import json

import pytest

from helpers import cli_ok, losses, write_llama_dir

pytestmark = pytest.mark.gpu

PEFT = "model.peft={kind: lora, r: 8, alpha: 16, targets: [wqkv, wo, w_gate_up, w_down]}"
COMMON = ["data=synthetic", "train.seq_len=128", "train.micro_batch_size=2", "train.log_interval=1",
          "train.progress=false", "launcher.nproc_per_node=1", "precision.compute_dtype=bf16",
          "precision.main_params_dtype=fp32", "precision.main_grads_dtype=fp32", "optim.warmup_steps=0",
          "optim.lr=1e-3", "checkpoint.interval_minutes=null"]
DIMS = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return write_llama_dir(tmp_path_factory.mktemp("lora") / "base", **DIMS)


def _train(run_dir, base, *overrides):
    out = cli_ok(*COMMON, f"model.init_from={base}", f"run.dir={run_dir}", *overrides, timeout=600)
    return out, losses(run_dir)


def test_megatron_fsdp_lora_trains_resumes_and_starts_at_the_base(tmp_path, base):
    from mfsdp_launch.checkpoint.weights import read_model_state
    from mfsdp_launch.models.lora import is_adapter

    a = tmp_path / "a"
    out, la = _train(a, base, "engine=megatron_fsdp", PEFT, "train.steps=6", "checkpoint.interval=3")
    assert "model.peft: LoRA r=8" in out.stdout
    assert la[6] < la[1], la
    state, found = read_model_state(a / "checkpoints" / "step_6")
    assert state and all(is_adapter(k) for k in state)
    assert found.manifest["model"]["peft"]["base"]["path"] == str(base)

    _, lb = _train(tmp_path / "b", base, "engine=megatron_fsdp", PEFT, "train.steps=6", "checkpoint.interval=3",
                   f"checkpoint.load_path={a / 'checkpoints' / 'step_3'}")
    for step in (4, 5, 6):
        assert lb[step] == pytest.approx(la[step], rel=1e-5), (step, la, lb)

    # B = 0 at the start: the first loss is the base's, whatever A's init and the engine.
    _, lm = _train(tmp_path / "meta", base, "engine=megatron_fsdp", PEFT, "train.steps=1", "model.init_on_meta=true")
    _, lf = _train(tmp_path / "fsdp2", base, "engine=fsdp2", PEFT, "train.steps=1")
    assert lm[1] == pytest.approx(la[1], rel=1e-3) and lf[1] == pytest.approx(la[1], rel=1e-2), (la[1], lm, lf)

    merged = tmp_path / "merged"
    cli_ok(str(a), str(merged), "--format", "hf", "--merge", module="mfsdp_launch.tools.export", timeout=300)
    assert json.loads((merged / "config.json").read_text())["hidden_size"] == DIMS["hidden_size"]


def test_megatron_fsdp_hf_lora_trains(tmp_path, base):
    run = tmp_path / "hf"
    out = cli_ok(*COMMON, "engine=megatron_fsdp", "model=hf", f"model.path={base}", "model.pretrained=true",
                 "model.peft={kind: lora, r: 8, alpha: 16, targets: [q_proj, v_proj]}", "train.steps=4",
                 f"run.dir={run}", timeout=600)
    assert "model.peft: LoRA r=8" in out.stdout
    got = losses(run)
    assert got[4] < got[1], got


def test_qlora_trains_over_an_nf4_base_on_one_gpu(tmp_path, base):
    """model.peft.kind=qlora under FSDP2 on a GPU: the adapted layers' weights in NF4 (CUDA), the
    first loss LoRA's within NF4's error, training, with meta-device init too."""
    pytest.importorskip("torchao")
    qlora = PEFT.replace("kind: lora", "kind: qlora")
    out, lq = _train(tmp_path / "q", base, "engine=fsdp2", qlora, "train.steps=6")
    assert "qlora: 16 base weights in NF4" in out.stdout, out.stdout[-2000:]
    _, lo = _train(tmp_path / "lo", base, "engine=fsdp2", PEFT, "train.steps=1")
    _, lm = _train(tmp_path / "qm", base, "engine=fsdp2", qlora, "train.steps=1", "model.init_on_meta=true")
    assert lq[1] != lo[1] and lq[1] == pytest.approx(lo[1], rel=1e-2) and lm[1] == pytest.approx(lq[1], rel=1e-3)
    assert lq[6] < lq[1], lq
