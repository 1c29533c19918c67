"""QLoRA (model.peft.kind=qlora, models/qlora.py) as mfsdp-train's ranks run it: `gpt` over a Hugging
Face Llama base on 2 gloo ranks under FSDP2. The base's linear layers but the head become NF4,
whole on each rank; the first loss is LoRA's within NF4's error; checkpoints hold the adapters only, with
the run's kind; a resume from a checkpoint quantizes the base again and continues on the same
losses, bitwise."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest

from helpers import SMOKE, train_ranks, write_llama_dir

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("peft", "torchao")),
                                reason="needs peft and torchao")

TARGETS = "targets: [wqkv, wo, w_gate_up, w_down]"
RUN = [*SMOKE, "data=synthetic", "train.seq_len=32", "train.micro_batch_size=2", "train.steps=4",
       "checkpoint.interval=2", "optim.warmup_steps=0", "optim.lr=1e-2"]


def _losses(run) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.slow
def test_qlora_trains_over_an_nf4_base_saves_adapters_and_resumes_bitwise(tmp_path):
    from mfsdp_launch.checkpoint.weights import read_model_state
    from mfsdp_launch.models import lora

    # hidden 128, ffn 256: every adapted weight is a multiple of 64 x 256 weights (NF4's blocks)
    base = write_llama_dir(tmp_path / "base", hidden_size=128, intermediate_size=256)
    runs = {}
    for kind in ("qlora", "lora"):
        runs[kind] = tmp_path / kind
        out = train_ranks(*RUN, f"model.peft={{kind: {kind}, r: 2, alpha: 4, {TARGETS}}}",
                          f"model.init_from={base}", f"run.dir={runs[kind]}")
        if kind == "qlora":
            assert "model.peft: QLoRA r=2 alpha=4 on 8 layers" in out
            assert "qlora: 8 base weights in NF4" in out and "whole on every rank" in out, out[-2000:]
    q, lo = _losses(runs["qlora"]), _losses(runs["lora"])
    assert sorted(q) == [1, 2, 3, 4]
    # Step 1: the same adapters (B = 0) over the base, dequantized: NF4's error only, and some of it.
    assert q[1] != lo[1] and q[1] == pytest.approx(lo[1], rel=1e-2)

    state, found = read_model_state(runs["qlora"] / "checkpoints" / "step_4")
    assert state and all(lora.is_adapter(k) for k in state), sorted(state)
    assert found.manifest["model"]["peft"]["kind"] == "qlora"

    # A resume from step 2 (a copy of the run without its step 4) loads the base, quantizes it again
    # and gives steps 3 and 4 exactly.
    again = tmp_path / "resumed"
    shutil.copytree(runs["qlora"], again)
    shutil.rmtree(again / "checkpoints" / "step_4")
    (again / "checkpoints" / "latest").unlink(missing_ok=True)
    (again / "metrics.jsonl").unlink()
    out = train_ranks(*RUN, f"model.peft={{kind: qlora, r: 2, alpha: 4, {TARGETS}}}", f"model.init_from={base}",
                      f"run.dir={again}")
    assert "step_2" in out
    resumed = _losses(again)
    assert [resumed[s] for s in (3, 4)] == [q[3], q[4]], (resumed, q)
