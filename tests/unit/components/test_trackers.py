"""Weights & Biases (offline) and MLflow (a local file store) through MetricsWriter, in real
processes: a second process resuming the run dir re-attaches to the same tracker run and sends
no step twice. Skipped when the package is not installed (pip install 'mfsdp-launch[wandb]',
'mfsdp-launch[mlflow]')."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import cli_env
from mfsdp_launch.core import rundir

# One training "attempt": rows from step a to b, as rank 0's MetricsWriter writes them after a
# resume at step a-1 (rows above the resume point are dropped, as a real resume does).
ATTEMPT = textwrap.dedent("""
    import sys
    from mfsdp_launch.components.metrics import MetricsWriter
    run_dir, tracker, first, last = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    cfg = {tracker: dict(enabled=True, **({"project": "ops-test"} if tracker == "wandb" else {}))}
    w = MetricsWriter(run_dir, enabled=True, start_step=first - 1, logging_cfg=cfg)
    for step in range(first, last + 1):
        w.write({"step": step, "loss": 10.0 / step, "lr": 1e-3, "mfu": None})
    w.close()
""")


def attempt(run_dir: Path, tracker: str, first: int, last: int) -> None:
    env = {**cli_env(), "WANDB_SILENT": "true", "WANDB_MODE": "offline"}
    r = subprocess.run([sys.executable, "-c", ATTEMPT, str(run_dir), tracker, str(first), str(last)],
                       capture_output=True, text=True, timeout=120, env=env, cwd=run_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warning" not in r.stderr, r.stderr[-3000:]


def crash_then_resume(run_dir: Path, tracker: str) -> dict:
    """Steps 1-7 sent, a crash after a checkpoint at 5, the resume sends 6-10."""
    run_dir.mkdir()
    (run_dir / rundir.CONFIG).write_text("run:\n  name: tracked\noptim:\n  lr: 0.001\n")
    attempt(run_dir, tracker, 1, 7)
    first = json.loads((run_dir / rundir.TRACKERS).read_text())[tracker]
    assert first["last_step"] == 7
    attempt(run_dir, tracker, 6, 10)
    second = json.loads((run_dir / rundir.TRACKERS).read_text())[tracker]
    assert second["run_id"] == first["run_id"] and second["last_step"] == 10
    return second


def wandb_records(path: Path):
    """The records of an offline .wandb file (W&B's leveldb-style log of protobuf Records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, buf, block = 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        if kind == 0:
            break
        buf += data[pos:pos + length]
        pos += length
        if kind in (1, 4):  # a whole record, or the last piece of one
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            yield rec


def test_wandb_offline_resume_reattaches_without_duplicate_steps(tmp_path):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'mfsdp-launch[wandb]')")
    run_dir = tmp_path / "run"
    state = crash_then_resume(run_dir, "wandb")
    files = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(f.name == f"run-{state['run_id']}.wandb" for f in files)
    steps, ids = [], set()
    for f in files:
        for rec in wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                ids.add(rec.run.run_id)
            elif kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                steps.append(items["_step"])
                assert items["loss"] == pytest.approx(10.0 / items["_step"])
    assert ids == {state["run_id"]}
    assert steps == list(range(1, 11))


def test_mlflow_file_store_resume_reattaches_without_duplicate_steps(tmp_path):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'mfsdp-launch[mlflow]')")
    run_dir = tmp_path / "run"
    state = crash_then_resume(run_dir, "mlflow")
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=state["tracking_uri"])
    history = client.get_metric_history(state["run_id"], "loss")
    assert sorted(m.step for m in history) == list(range(1, 11))
    assert client.get_run(state["run_id"]).data.params["optim.lr"] == "0.001"
    assert client.get_run(state["run_id"]).info.status == "FINISHED"
    assert len(client.search_runs([client.get_experiment_by_name("mfsdp-launch").experiment_id])) == 1


def test_a_tracker_that_is_not_installed_is_a_warning(tmp_path):
    """Run in a process where the package cannot be imported: training goes on."""
    code = textwrap.dedent("""
        import sys
        sys.modules["wandb"] = None  # as if not installed
        from mfsdp_launch.components.metrics import MetricsWriter
        w = MetricsWriter(sys.argv[1], enabled=True, logging_cfg={"wandb": True})
        w.write({"step": 1, "loss": 1.0})
        w.close()
    """)
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                       env=cli_env())
    assert r.returncode == 0, r.stderr
    assert "warning: logging.wandb.enabled=true but wandb is not installed" in r.stderr
    assert json.loads((tmp_path / rundir.METRICS).read_text())["step"] == 1
