"""run.dir=s3://...: a CPU run against a local S3 server (moto, started here) saves its
checkpoints and metrics into the bucket, resumes from one bitwise (the same losses and weights
as the run that went straight on), and exports from and into the bucket."""

from __future__ import annotations

import re

import pytest

from helpers import cli_ok, local_s3, read_metrics

SMALL = ["+recipe=cpu_smoke", "model.preset=tiny", "train.seq_len=64", "data.max_bytes=2000000",
         "train.log_interval=1", "train.grad_accum_steps=1", "train.micro_batch_size=2", "train.progress=false",
         "train.steps=4", "checkpoint.interval=2"]


@pytest.mark.slow
def test_an_s3_run_saves_resumes_bitwise_and_exports(tmp_path):
    import torch
    from safetensors.torch import load

    from mfsdp_launch import checkpoint as C
    from mfsdp_launch.core import storage
    from mfsdp_launch.tools.export import export

    url = "s3://runs/exp/a"
    with local_s3("runs") as env:
        first = cli_ok(*SMALL, f"run.dir={url}", cwd=tmp_path, env=env, timeout=300)
        assert f"run.dir={url}" in first.stdout and "finished step 4/4" in first.stdout
        # The end-of-run line: 4 steps x 2 ranks x 2 samples x 64 tokens, a small part of the data.
        assert re.search(r"loss \d\.\d{4}, 1\.02k tokens \([0-9.e-]+ epochs of the data\)", first.stdout), first.stdout
        straight = {r["step"]: r["loss"] for r in read_metrics(url) if "loss" in r}
        assert sorted(straight) == [1, 2, 3, 4]
        assert [s for s, _ in C.list_step_dirs(C.checkpoints_dir(url))] == [2, 4]
        assert storage.path(f"{url}/config.yaml").is_file() and not storage.path(f"{url}/run.lock").exists()
        local = tmp_path / "runs" / "s3" / "runs" / "exp" / "a"  # logs and the ranks' config on this machine
        assert (local / "config.yaml").is_file() and (local / "logs" / "launcher.log").is_file()
        export(f"{url}/checkpoints/step_4", "s3://runs/exp/a.safetensors")

        # Back to step 2 (its checksums verified in the store), on to 4 again.
        again = cli_ok(*SMALL, f"run.dir={url}", "checkpoint.load_step=2", cwd=tmp_path, env=env, timeout=300)
        assert f"resuming from step 2 ({url}/checkpoints/step_2)" in again.stdout
        resumed = {r["step"]: r["loss"] for r in read_metrics(url) if "loss" in r}
        assert resumed == straight  # rows 3 and 4 again, the same bits
        assert export(url, "s3://runs/exp/b.safetensors")["step"] == 4
        a = load(storage.path("s3://runs/exp/a.safetensors").read_bytes())
        b = load(storage.path("s3://runs/exp/b.safetensors").read_bytes())
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
