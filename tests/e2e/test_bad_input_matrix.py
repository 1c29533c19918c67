"""Issue 28's failure matrix, the bad inputs refused before anything starts: a custom forward that
cannot take the batch contract's call, a unit class that does not exist, a typo in a
data.sources entry, TensorBoard asked for but not installed, run dirs Hydra's grammar cannot
read bare, an unreachable MLflow server, and `mfsdp-data prepare` on unreadable, empty or
field-less input and two prepares into one --out at once."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from helpers import cli, cli_env, cli_error, refused, write_user_module

torch = pytest.importorskip("torch")

MODULE = "mfsdp_bad_forward_model"
BAD_FORWARDS = '''
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, dim=16):
        super().__init__()
        self.ff = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.ff(x)


class TakesAMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(256, 16), nn.Linear(16, 256)
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, input_ids, mask):  # a second required argument the contract never passes
        x = self.emb(input_ids)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


class NoLabels(TakesAMask):
    def forward(self, input_ids):
        return super().forward(input_ids, None)


def takes_a_mask():
    return TakesAMask()


def no_labels():
    return NoLabels()
'''


@pytest.fixture(scope="module")
def user_module(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user_code")
    write_user_module(folder, BAD_FORWARDS, MODULE)
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))


def one_line(exc, key: str) -> str:
    """The message of a ConfigError `refused` returned: one line naming `key`."""
    msg = str(exc)
    assert "\n" not in msg and msg.startswith(key + ": "), msg
    return msg


def custom(target: str, *more: str) -> list:
    return ["+recipe=cpu_smoke", "model=custom", f"model.target={MODULE}:{target}",
            f"model.fsdp_unit_modules=[{MODULE}.Block]", *more]


def test_a_forward_that_cannot_take_input_ids_alone_is_one_line(user_module):
    msg = one_line(refused(*custom("takes_a_mask")), "model.target")
    assert "TakesAMask.forward(input_ids, mask) cannot be called as forward(input_ids)" in msg, msg
    assert "missing a required argument: 'mask'" in msg


def test_loss_model_with_a_forward_without_labels_is_one_line(user_module):
    msg = one_line(refused(*custom("no_labels", "model.loss=model")), "model.loss")
    assert "NoLabels.forward(input_ids) cannot be called as forward(input_ids, labels)" in msg, msg
    assert "cross_entropy" in msg


def test_a_missing_unit_class_proposes_the_classes_that_exist(user_module):
    msg = one_line(refused("+recipe=cpu_smoke", "model=custom", f"model.target={MODULE}:no_labels",
                           f"model.fsdp_unit_modules=[{MODULE}.Blokc]"), "model.fsdp_unit_modules")
    assert f"has no attribute 'Blokc' (the model repeats: {MODULE}.Block)" in msg, msg


@pytest.mark.parametrize("override, key", [
    ("data.sources=[{path: /x}, {path: /y, wieght: 2}]", "data.sources[1].wieght"),
    ("data.val_sources=[{pth: /x}]", "data.val_sources[0].pth"),
])
def test_a_typo_in_a_data_sources_entry_names_the_entry(override, key):
    msg = one_line(refused("+recipe=cpu_smoke", "data=tokens", override), key)
    assert msg == f"{key}: unknown key (allowed: path|weight)"


def test_tensorboard_asked_for_but_not_installed_is_refused():
    import importlib.util

    if importlib.util.find_spec("tensorboard") is not None:
        pytest.skip("tensorboard is installed here")
    msg = one_line(refused("+recipe=cpu_smoke", "logging.tensorboard=true", hardware=True), "logging.tensorboard")
    assert "needs tensorboard, which is not installed" in msg


@pytest.mark.parametrize("run_dir", ["runs/ünï cödé", "runs/it's (copy 2)", "runs/a=b#c", "runs/ä,b"])
def test_any_path_composes_as_a_run_dir(run_dir, tmp_path):
    """What the CLI passes to Hydra: take_options quotes what Hydra's grammar cannot read bare."""
    from mfsdp_launch.launcher.cli import take_options
    from mfsdp_launch.planner.compose import compose

    path = str(tmp_path / run_dir)
    overrides, _ = take_options(["+recipe=cpu_smoke", f"run.dir={path}"])
    assert compose(overrides).run.dir == path


def test_a_value_hydra_cannot_read_hints_quoting():
    from mfsdp_launch.core.errors import ConfigError
    from mfsdp_launch.planner.compose import compose

    with pytest.raises(ConfigError) as e:
        compose(["+recipe=cpu_smoke", "run.name=(a"])
    assert str(e.value).startswith("overrides: ") and "quote a value with special characters: key='a,b'" in str(e.value)


def test_an_unreachable_mlflow_server_is_a_warning_within_seconds(tmp_path):
    pytest.importorskip("mlflow")
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = textwrap.dedent(f"""
        from mfsdp_launch.components.trackers import open_trackers
        t = open_trackers({{"mlflow": {{"enabled": True, "tracking_uri": "http://127.0.0.1:{port}"}}}}, {str(tmp_path)!r})
        print("opened", bool(t))
    """)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90, env=cli_env())
    assert r.returncode == 0 and "opened False" in r.stdout, r.stderr[-2000:]
    assert f"mlflow: could not start: TrackerUnreachable: the tracking server http://127.0.0.1:{port} did not " \
           "answer within 5 s" in r.stderr
    assert time.monotonic() - t0 < 60  # (MLflow's own retries took about 4 minutes)


# --- mfsdp-data prepare --------------------------------------------------------------------------


def data_cli(*args):
    return cli(*args, module="mfsdp_launch.corpus.prepare", timeout=180)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    pytest.importorskip("tokenizers")
    from mfsdp_launch.corpus.tokenizer import train_bpe

    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    return train_bpe(["the quick brown fox jumps over the lazy dog " * 20, "hello world " * 50], 300, str(path))


def prepare(tokenizer, *inputs, out, more=()):
    return data_cli("prepare", *map(str, inputs), "--tokenizer", tokenizer, "--out", str(out), "--quiet",
                    "--workers", "1", *more)


def test_prepare_unreadable_input_or_dangling_link_is_one_line_exit_2(tmp_path, tokenizer):
    link = tmp_path / "gone.jsonl"
    link.symlink_to(tmp_path / "nowhere.jsonl")
    line = cli_error(prepare(tokenizer, link, out=tmp_path / "o1"), tool="mfsdp-data prepare")
    assert f"{link} is a symbolic link to " in line and "which does not exist" in line, line
    if os.geteuid() == 0:  # root reads any file mode: a file whose read fails (EIO) instead
        unreadable = tmp_path / "mem.txt"
        unreadable.symlink_to(f"/proc/{os.getpid()}/mem")
    else:
        unreadable = tmp_path / "secret.txt"
        unreadable.write_text("text")
        unreadable.chmod(0)
    line = cli_error(prepare(tokenizer, unreadable, out=tmp_path / "o2"), tool="mfsdp-data prepare")
    assert f"INPUT: cannot read {unreadable}: " in line, line
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


@pytest.mark.parametrize("bad", ["empty", "no_field"])
def test_prepare_refused_input_leaves_no_out_and_the_fixed_input_works(tmp_path, tokenizer, bad):
    src = tmp_path / "in.jsonl"
    src.write_text("" if bad == "empty" else json.dumps({"body": "text in another field"}) + "\n")
    out = tmp_path / "out"
    line = cli_error(prepare(tokenizer, src, out=out), tool="mfsdp-data prepare")
    assert "no documents with text" in line and not out.exists(), line
    src.write_text("".join(json.dumps({"text": f"document {i} of the fixed input"}) + "\n" for i in range(20)))
    r = prepare(tokenizer, src, out=out)
    assert r.returncode == 0 and "20 documents" in r.stdout, r.stderr


def test_two_prepares_into_one_out_are_serialized(tmp_path, tokenizer):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": f"document {i} " + "with some words in it " * 30}) + "\n"
                           for i in range(1000)))
    out = tmp_path / "out"
    args = [sys.executable, "-m", "mfsdp_launch.corpus.prepare", "prepare", str(src), "--tokenizer", tokenizer,
            "--out", str(out), "--quiet", "--workers", "1", "--shard-mb", "0.2"]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env())
             for _ in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    text = "".join(o + e for o, e in outs)
    assert "Traceback" not in text and "FileNotFoundError" not in text, text
    assert "already prepared" in text and "waiting for it to finish" in text, text
    r = data_cli("verify", str(out))
    assert r.returncode == 0, r.stderr
