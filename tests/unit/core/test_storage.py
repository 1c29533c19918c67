"""core/storage.py against a real S3 API (moto's server on a loopback port, started here): the
path operations, a checkpoint saved, verified, damaged and resumed in an object store, an
export to and from it, the run lease, and the one-line refusals of bad object-store configs."""

from __future__ import annotations

import json
import time

import pytest

from helpers import local_s3, refused
from mfsdp_launch import checkpoint as C
from mfsdp_launch.core import storage
from mfsdp_launch.core.errors import ConfigError


@pytest.fixture
def s3():
    with local_s3("runs") as env:
        yield env


def test_paths_and_operations(s3):
    root = storage.path("s3://runs/a/b")
    assert isinstance(root, storage.RemotePath) and str(root) == "s3://runs/a/b" and not root.exists()
    assert root.name == "b" and root.parent == storage.path("s3://runs/a") and storage.path(root) is root
    (root / "x" / "f.txt").write_text("hi")
    (root / "x" / "sub" / "g.bin").write_bytes(b"1234")
    assert root.is_dir() and (root / "x" / "f.txt").is_file() and not (root / "x").is_file()
    assert [(c.name, c.is_dir()) for c in root.iterdir()] == [("x", True)]
    assert storage.walk_files(root) == [("x/f.txt", 2), ("x/sub/g.bin", 4)]
    storage.replace(root / "x", root / "y")
    assert storage.walk_files(root) == [("y/f.txt", 2), ("y/sub/g.bin", 4)] and not (root / "x").exists()
    assert storage.put_if_absent(root / "lock", b"1") and not storage.put_if_absent(root / "lock", b"2")
    assert (root / "lock").read_text() == "1"  # the conditional put refused to replace it
    storage.atomic_write(root / "z", lambda f: f.write(b"zz"))
    log = storage.open_append(root / "log", flush_s=3600)
    log.write("a\n")
    assert not (root / "log").exists()  # held back until a flush or the close
    log.close()
    assert (root / "log").read_text() == "a\n" and (root / "z").stat().st_size == 2
    storage.rmtree(root / "y")
    assert sorted(storage.listdir(root)) == ["lock", "log", "z"]
    assert storage.local_run_dir(type("R", (), {"dir": str(root), "local_dir": None})()).as_posix() == "runs/s3/runs/a/b"


def _manager(run_dir, engine, **ck):
    from mfsdp_launch.core.schema import CheckpointConfig

    return C.CheckpointManager(CheckpointConfig(**ck), run_dir, manifest_info={"seed": 1}, rank=0, world_size=1,
                               engine=engine)


def test_checkpoints_in_an_object_store_save_verify_fall_back_and_export(s3, tmp_path):
    """One process, real DCP through its fsspec writer: saved, listed, exported, then one object
    damaged: the checksums find it and a resume falls back to the step before."""
    import torch
    import torch.nn as nn
    from safetensors.torch import load

    from mfsdp_launch.engines.fsdp2 import FSDP2Engine
    from mfsdp_launch.tools.export import export

    engine = FSDP2Engine(engine_cfg=None, sharding_cfg=None, precision_cfg=None, dims=None, mesh=None,
                         device=torch.device("cpu"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mgr = _manager("s3://runs/r", engine, interval=1)
    assert mgr.resume(model, opt, None, None) is None
    weights = {}
    for step in (1, 2):
        model(torch.randn(2, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
        mgr.maybe_save(step, model, opt, None, None)
        weights[step] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ckpts = storage.path("s3://runs/r/checkpoints")
    assert [s for s, _ in C.list_step_dirs(ckpts)] == [1, 2] and C.read_latest_pointer(ckpts) == "step_2"
    found, damaged = C.find_latest(ckpts)
    assert found.step == 2 and not damaged and C.verify_checksums(found.path, found.manifest) is None

    local = export("s3://runs/r", tmp_path / "model.safetensors")  # from the store to a file
    assert local["step"] == 2 and local["source"] == "s3://runs/r/checkpoints/step_2"
    exported = load((tmp_path / "model.safetensors").read_bytes())
    for k, v in weights[2].items():
        assert torch.equal(exported[k], v)

    # One object of step_2 rewritten with other bytes of the same size: the checksum finds it.
    shard = next(e["path"] for e in found.manifest["files"] if e["path"].endswith(".distcp"))
    blob = bytearray((found.path / shard).read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (found.path / shard).write_bytes(bytes(blob))
    assert C.inspect_checkpoint(found.path)[1] is None  # sizes alone cannot tell
    assert C.verify_checksums(found.path, found.manifest) == f"checksum mismatch in {shard}"
    fresh = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert _manager("s3://runs/r", engine).resume(fresh, fresh_opt, None, None) == 1  # falls back past it
    for k, v in weights[1].items():
        assert torch.equal(fresh.state_dict()[k], v)


def test_the_lease_of_an_object_store_run_dir(s3, capsys):
    from mfsdp_launch.launcher.lease import ObjectLease

    with ObjectLease("s3://runs/l", command="mfsdp-train first") as lease:
        record = json.loads(storage.path("s3://runs/l/run.lock").read_text())
        assert record["command"] == "mfsdp-train first" and record["token"] == lease.token
        with pytest.raises(ConfigError) as e:
            ObjectLease("s3://runs/l").acquire()
        assert "\n" not in str(e.value) and str(e.value).startswith("run.dir: s3://runs/l is in use by pid")
    assert not storage.path("s3://runs/l/run.lock").exists()  # released: deleted
    stale = dict(record, expires=time.time() - 1)  # a holder that stopped renewing (killed)
    storage.path("s3://runs/l/run.lock").write_text(json.dumps(stale))
    with ObjectLease("s3://runs/l", command="second") as lease:
        assert json.loads(storage.path("s3://runs/l/run.lock").read_text())["token"] == lease.token
    assert "taking over s3://runs/l/run.lock" in capsys.readouterr().err


def test_object_store_refusals_are_one_line():
    assert refused("+recipe=cpu_smoke", "run.local_dir=/tmp/x").key == "run.local_dir"
    assert refused("+recipe=cpu_smoke", "run.dir=s3://").key == "run.dir"
    assert refused("+recipe=cpu_smoke", "run.dir=nosuch://b/p").key == "run.dir"
    assert "launcher=torchrun only" in refused("+recipe=cpu_smoke", "run.dir=s3://b/p", "launcher=slurm").problem
    import importlib.util

    if importlib.util.find_spec("gcsfs") is None:  # gs:// goes the same way: its backend is named
        assert refused("+recipe=cpu_smoke", "run.dir=gs://b/p").problem == "gs:// needs gcsfs, which is not installed"
