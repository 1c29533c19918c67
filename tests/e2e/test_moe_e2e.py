"""A mixture of experts as mfsdp-train's 2 CPU ranks run it (helpers.train_ranks; what the CLI
adds around the ranks is the other e2e files'): `+recipe=cpu_smoke model.moe.experts=4
model.moe.top_k=2 mesh.ep=2` trains (loss falling, expert load and aux loss in metrics), its
checkpoint at ep=2 resumes at ep=1 on the same curve (so 2 ranks at ep=2 compute what ep=1 does),
and `mfsdp-export --format hf` writes the run as a Mixtral directory (its logits against
transformers are tests/unit/models/test_moe.py's)."""

from __future__ import annotations

import json

from helpers import SMOKE, losses, train_ranks, train_rows

MOE = ["model.moe.experts=4", "model.moe.top_k=2"]
STEPS = 6


def test_moe_ep2_trains_resumes_at_ep1_and_exports(tmp_path):
    first = tmp_path / "ep2"
    train_ranks(*SMOKE, f"run.dir={first}", *MOE, "mesh.ep=2", f"train.steps={STEPS}", "checkpoint.interval=3")
    rows = train_rows(first)
    ep2 = losses(first)
    assert sorted(ep2) == list(range(1, STEPS + 1)) and ep2[STEPS] < ep2[1]
    assert len(rows[STEPS]["moe_load_max"]) == 2 and rows[STEPS]["moe_aux_loss"] > 0.9

    second = tmp_path / "ep1"
    train_ranks(*SMOKE, f"run.dir={second}", *MOE, "mesh.ep=1", f"train.steps={STEPS}",
                f"checkpoint.load_path={first / 'checkpoints' / 'step_3'}")
    ep1, resumed = losses(second), train_rows(second)
    assert sorted(ep1) == list(range(4, STEPS + 1))
    assert max(abs(ep1[s] - ep2[s]) / abs(ep2[s]) for s in ep1) < 1e-5
    # the gradient norms too: a mis-scaled expert gradient shows there first
    assert max(abs(resumed[s]["grad_norm"] - rows[s]["grad_norm"]) / rows[s]["grad_norm"] for s in ep1) < 1e-5

    from mfsdp_launch.models.llama.hf_export import export_checkpoint

    info = export_checkpoint(first, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert info["step"] == STEPS and config["architectures"] == ["MixtralForCausalLM"]
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (4, 2, 192)
