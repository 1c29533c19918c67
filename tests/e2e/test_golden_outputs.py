"""The CLI's user-facing text (every recipe's dry run and --cfg, --help, refusals) against outputs
recorded before the package was rearranged: a move must not change what a user sees.

Record again (after an intended change) with MFSDP_RECORD_GOLDEN=1 and review the diff."""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import ROOT, cli

GOLDEN = ROOT / "tests" / "golden"
RECIPES = ("cpu_smoke", "fsdp_bf16", "hfsdp_bf16", "hfsdp_fp8", "hsdp_bf16")

# name -> CLI arguments; each is run in an empty working directory.
CASES = {"help": ["--help"], "no_args": [], "version": ["--version"]}
for _r in RECIPES:
    CASES[f"dry_{_r}"] = [f"+recipe={_r}", "launcher.dry_run=true"]
    CASES[f"dry8_{_r}"] = [f"+recipe={_r}", "launcher.dry_run=true", "launcher.nproc_per_node=8"]
    CASES[f"cfg_{_r}"] = [f"+recipe={_r}", "launcher.dry_run=true", "--cfg"]
for _m in ("gpt", "te_gpt", "toy_cnn", "toy_transformer", "te_toy_transformer"):
    CASES[f"dry_model_{_m}"] = [f"model={_m}", "launcher.dry_run=true", "launcher.nproc_per_node=2"]
    CASES[f"dry_mfsdp_{_m}"] = [f"model={_m}", "engine=megatron_fsdp", "launcher.dry_run=true",
                                "launcher.nproc_per_node=2"]
CASES.update({
    "cfg_default": ["launcher.dry_run=true", "--cfg"],
    "dry_tp2": ["+recipe=cpu_smoke", "mesh.tp=2", "launcher.dry_run=true", "launcher.nproc_per_node=4"],
    "dry_cp2": ["+recipe=cpu_smoke", "mesh.cp=2", "launcher.dry_run=true", "launcher.nproc_per_node=4"],
    "dry_ac": ["+recipe=cpu_smoke", "model.activation_checkpointing=full", "launcher.dry_run=true"],
    "dry_slurm": ["+recipe=hfsdp_fp8", "launcher=slurm", "launcher.nnodes=2", "launcher.gpus_per_node=8",
                  "launcher.dry_run=true"],
    "bad_world": ["+recipe=cpu_smoke", "mesh.dp_shard=3", "launcher.nproc_per_node=4", "launcher.dry_run=true"],
    "bad_key": ["+recipe=cpu_smoke", "train.stepz=3", "launcher.dry_run=true"],
    "bad_enum": ["+recipe=cpu_smoke", "sharding.zero_dp_strategy=5", "launcher.dry_run=true"],
    "bad_family_key": ["model=gpt", "model.target=x:y", "launcher.dry_run=true"],
    "bad_tp_toy": ["model=toy_cnn", "mesh.tp=2", "launcher.nproc_per_node=2", "launcher.dry_run=true"],
    "bad_ac_toy": ["model=toy_cnn", "model.activation_checkpointing=full", "launcher.dry_run=true"],
    "bad_doc_mask": ["model=toy_transformer", "data=text", "data.doc_mask=true", "launcher.dry_run=true"],
    "bad_fused_loss": ["model=toy_cnn", "model.loss_kernel=te_fused", "launcher.dry_run=true"],
    "bad_recipe": ["+recipe=nope", "launcher.dry_run=true"],
    "bad_mbs": ["+recipe=cpu_smoke", "train.micro_batch_size=0", "launcher.dry_run=true"],
    "bad_fp8_fsdp2": ["model=gpt", "fp8.recipe=delayed", "launcher.dry_run=true"],
})


def normalize(text: str, cwd: Path) -> str:
    text = text.replace(str(cwd), "<cwd>").replace(str(ROOT), "<root>")
    # Timings the dry run may print.
    return re.sub(r"\d+\.\d+ s\b", "<t> s", text)


def run_case(name: str, tmp: Path) -> dict:
    cwd = tmp / name
    cwd.mkdir()
    out = cli(*CASES[name], cwd=cwd, timeout=120, env={"COLUMNS": "120"})
    return {"rc": out.returncode, "stdout": normalize(out.stdout, cwd), "stderr": normalize(out.stderr, cwd)}


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("golden")
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = dict(zip(CASES, pool.map(lambda n: run_case(n, tmp), CASES)))
    if os.environ.get("MFSDP_RECORD_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        for name, res in results.items():
            (GOLDEN / f"{name}.json").write_text(json.dumps(res, indent=1, sort_keys=True) + "\n")
    return results


@pytest.mark.parametrize("name", sorted(CASES))
def test_output_unchanged(outputs, name):
    recorded = json.loads((GOLDEN / f"{name}.json").read_text())
    got = outputs[name]
    assert got["rc"] == recorded["rc"], got
    assert got["stdout"].splitlines() == recorded["stdout"].splitlines()
    assert got["stderr"].splitlines() == recorded["stderr"].splitlines()
