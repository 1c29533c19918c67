"""`model=custom`: a user's module written to a temporary directory on PYTHONPATH trains (as
mfsdp-train's ranks run it; its resume through the CLI) under FSDP2 on 2 gloo processes with
meta-device init and a freeze glob, checkpoints, resumes exactly, reshards to 1 process, and
exports; bad input is one line, exit 2."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from helpers import USER_MODULE_NAME as MODULE_NAME
from helpers import ROOT, cli, cli_env, cli_ok, read_metrics, refused, train_ranks, unknown_key, write_user_module

torch = pytest.importorskip("torch")

TARGET = f"model.target={MODULE_NAME}:build"
UNITS = f"model.fsdp_unit_modules=[{MODULE_NAME}.Block]"
RUN = ["+recipe=cpu_smoke", "model=custom", TARGET, UNITS, "train.log_interval=1", "train.progress=false",
       "train.seq_len=32", "data.max_bytes=2000000"]


@pytest.fixture(scope="module")
def user_env(tmp_path_factory):
    return write_user_module(tmp_path_factory.mktemp("user_code"))


def train(env, run_dir, *overrides):
    return cli_ok(*RUN, f"run.dir={run_dir}", *overrides, env=env, timeout=300)


def train_as_ranks(env, run_dir, *overrides, monkeypatch):
    """mfsdp-train's ranks (helpers.train_ranks), the user's module importable here too (the
    launcher's checks build the model in this process); returns rank 0's output."""
    monkeypatch.syspath_prepend(env["PYTHONPATH"].split(os.pathsep)[0])
    return train_ranks(*RUN, f"run.dir={run_dir}", *overrides, env=env)


def weights(ckpt):
    from mfsdp_launch.checkpoint.weights import read_model_state

    return read_model_state(ckpt)[0]


@pytest.mark.slow
def test_custom_model_trains_resumes_exactly_reshards_and_freezes(tmp_path, user_env, monkeypatch):
    """A and C run as mfsdp-train's ranks (helpers.train_ranks); B, the resume, through the CLI."""
    a, b, c = tmp_path / "A", tmp_path / "B", tmp_path / "C"
    meta = ["model.init_on_meta=true", "model.freeze=[emb.*]"]
    out = train_as_ranks(user_env, a, "train.steps=4", "checkpoint.interval=2", *meta, monkeypatch=monkeypatch)
    assert "model custom:" in out and "(1 frozen tensors)" in out, out
    losses_a = {r["step"]: r["loss"] for r in read_metrics(a)}
    assert sorted(losses_a) == [1, 2, 3, 4] and losses_a[4] < losses_a[1]

    # B resumes from A's step-2 checkpoint on the same mesh: the same losses and weights as A.
    for run in (b, c):
        (run / "checkpoints").mkdir(parents=True)
        shutil.copytree(a / "checkpoints" / "step_2", run / "checkpoints" / "step_2")
    assert "resuming from step 2" in train(user_env, b, "train.steps=4", *meta).stdout
    assert {r["step"]: r["loss"] for r in read_metrics(b)} == {3: losses_a[3], 4: losses_a[4]}  # bit-identical

    w2, w4, wb = (weights(p) for p in (a / "checkpoints" / "step_2", a / "checkpoints" / "step_4", b))
    assert w4.keys() == wb.keys() and all(torch.equal(w4[k], wb[k]) for k in w4)
    assert torch.equal(w2["emb.weight"], w4["emb.weight"])  # frozen by model.freeze
    assert not torch.equal(w2["head.weight"], w4["head.weight"])

    # C continues A's step 2 on 1 process (DCP reshards), with the same global batch.
    train_as_ranks(user_env, c, "train.steps=3", "launcher.nproc_per_node=1", "mesh.dp_shard=1",
                   "train.micro_batch_size=16", *meta, monkeypatch=monkeypatch)
    assert [r["step"] for r in read_metrics(c)] == [3]
    assert read_metrics(c)[0]["loss"] == pytest.approx(losses_a[3], rel=1e-4)


def test_dry_run_sizes_come_from_a_meta_build_without_torch_in_the_launcher(user_env):
    code = ("import sys\nfrom mfsdp_launch.launcher.cli import main\nrc = main(sys.argv[1:])\n"
            "print('torch imported:', 'torch' in sys.modules, 'user code imported:', %r in sys.modules)\n"
            "sys.exit(rc)" % MODULE_NAME)
    args = [*RUN, "model.kwargs={dim: 64, n_layers: 3}", "launcher.dry_run=true"]
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                         env={**cli_env(), **user_env}, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "torch imported: False user code imported: False" in out.stdout
    # 3 blocks of (LayerNorm 2*64 + Linear 64->256 + Linear 256->64) + embedding + head
    n = 3 * (2 * 64 + 64 * 256 + 256 + 256 * 64 + 64) + 2 * 256 * 64
    assert f"custom {MODULE_NAME}:build (3 units: Block; loss=cross_entropy; vocab=256) params={n:,}" in out.stdout
    assert f"flops/token={6 * (3 * 2 * 64 * 256 + 256 * 64):.3e}" in out.stdout


def test_bad_input_is_one_line_before_spawning(tmp_path, user_env):
    """Through the CLI: the check runs in a short-lived process (which imports torch and builds the
    user's model) and comes back as one line. One case is enough for that path; the other checks
    run in-process below (test_more_bad_input_is_one_line), each CLI case costing a torch import."""
    overrides = [TARGET]
    expected = ("model.fsdp_unit_modules: is empty; name the classes to shard one by one "
                f"(the model repeats: {MODULE_NAME}.Block)")
    out = cli("model=custom", f"run.dir={tmp_path / 'run'}", *overrides, env=user_env)
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr.strip() == f"mfsdp-train: error: {expected}", out.stderr
    assert not (tmp_path / "run").exists()  # nothing was spawned


MORE_MODELS = """
import torch
import torch.nn as nn
from {module} import LM


class Scale(nn.Module):  # owns a parameter, has no reset_parameters()
    def __init__(self, dim):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * self.gain


class ScaledLM(LM):
    def __init__(self):
        super().__init__(256, 32, 2)
        self.scale = Scale(32)


class LogitsNotLoss(LM):
    def __init__(self):
        super().__init__(256, 32, 2)

    def forward(self, input_ids, labels):  # breaks the contract: returns logits, not the loss
        return super().forward(input_ids)
"""


@pytest.mark.parametrize("overrides,expected", [
    (["model.target=no_such_module_xyz:build"],
     "model.target: cannot import 'no_such_module_xyz:build': no module named 'no_such_module_xyz' "
     "(is its directory on PYTHONPATH?)"),
    ([f"model.target={MODULE_NAME}:NOT_CALLABLE"], f"model.target: '{MODULE_NAME}:NOT_CALLABLE' is a int, not callable"),
    ([TARGET, "model.fsdp_unit_modules=[torch.nn.Conv2d]"],
     f"model.fsdp_unit_modules: the model contains no torch.nn.Conv2d (it repeats: {MODULE_NAME}.Block)"),
    ([TARGET, UNITS, "data=text", "model.kwargs={vocab: 100}"],
     "model.vocab_size: 100 is smaller than the vocab 256 of the byte tokenizer (data.tokenizer=null)"),
    ([TARGET, UNITS, "model.vocab_size=300"], "model.vocab_size: 300 is larger than the model's vocabulary (256)"),
    ([TARGET, UNITS, "model.dim=64"], unknown_key("model.dim", "custom")),
    ([TARGET, UNITS, "model.kwargs=3"], "model.kwargs: must be a mapping of keyword arguments, got 3 "
                                        "(allowed: {name: value})"),
    ([TARGET, UNITS, "model.kwargs={depth: 3}"],
     "model.kwargs: mfsdp_test_usermodel:build: got an unexpected keyword argument 'depth'"),
    ([TARGET, UNITS, "model.init_fn=no_such_module_xyz.init"],
     "model.init_fn: cannot import 'no_such_module_xyz.init': no module named 'no_such_module_xyz' "
     "(is its directory on PYTHONPATH?)"),
    ([f"model.target={MODULE_NAME}_more:ScaledLM", UNITS, "model.init_on_meta=true"],
     "model.init_on_meta: true, but scale (Scale) holds parameters and has no reset_parameters(), so they would "
     "stay uninitialized (allowed: false, or model.init_fn=pkg.module:fn)"),
    ([f"model.target={MODULE_NAME}_more:LogitsNotLoss", UNITS],
     "model.loss: model.loss=auto (resolved to model): forward(input_ids, labels) returned (1, 8, 256), not the "
     "scalar loss (allowed: cross_entropy, or return the loss)"),
    ([TARGET, UNITS, "model.freeze=[nope.*]"], "model.freeze: 'nope.*' matches no parameter (allowed: emb.weight, "
                                               "head.weight, blocks.0.norm.weight, blocks.0.norm.bias, "
                                               "blocks.0.ff.0.weight, blocks.0.ff.0.bias, ...)"),
    ([TARGET, UNITS, "model.path=/x"], unknown_key("model.path", "custom")),
], ids=["not-importable", "not-callable", "unit-absent", "vocab", "vocab-too-large", "gpt-key", "kwargs-type",
        "kwargs-name", "init-fn", "no-reset", "contract", "freeze", "foreign-key"])
def test_more_bad_input_is_one_line(tmp_path, monkeypatch, overrides, expected):
    """The same checks in-process (this process has torch, so the probe runs here: fast)."""
    write_user_module(tmp_path)
    write_user_module(tmp_path, MORE_MODELS.format(module=MODULE_NAME), name=f"{MODULE_NAME}_more")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert str(refused("model=custom", *overrides)) == expected
