"""Time checkpoint saves and loads of the `gpt` preset 125m (134M params) on CPU/gloo, FSDP2.

    python scripts/bench_checkpoint.py [--world 1 2] [--preset 125m] [--dir /tmp/bench_ckpt]

For each world size: one training step (so AdamW has real moments), then two synchronous saves,
one async save (time blocked vs time until committed), one resume into a fresh model, and the
checksum work alone (a save's own files per rank; a resume's verification, 1/world per rank).
Prints one JSON line per world size. Uses real DCP on the local disk (fsync on).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _child(rank: int, world: int, port: int, workdir: Path, preset: str, device_type: str) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    sys.path.insert(0, str(ROOT))
    from mfsdp_launch.checkpoint import CheckpointManager, manifest_info_from_config
    from mfsdp_launch.engines.fsdp2 import FSDP2Engine
    from mfsdp_launch.mesh import ParallelDims
    from mfsdp_launch.models import build_model_spec
    from mfsdp_launch.core.schema import CheckpointConfig, Config, EngineConfig, PrecisionConfig, ShardingConfig
    from mfsdp_launch.core.sharding import ZeroStrategy

    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=timedelta(seconds=600))
    cfg = Config()
    cfg.model.preset = preset
    cfg.run.dir = str(workdir)
    info = manifest_info_from_config(cfg, world_size=world)
    dims = ParallelDims(1, world, 1, 1)
    mesh = dims.build(device_type)

    def build(seed):
        torch.manual_seed(seed)
        spec = build_model_spec(cfg.model, 32)
        with device:
            model = spec.build()
        engine = FSDP2Engine(engine_cfg=EngineConfig(), sharding_cfg=ShardingConfig(zero_dp_strategy=ZeroStrategy.optim_grads_params),
                             precision_cfg=PrecisionConfig(compute_dtype="fp32"), dims=dims, mesh=mesh,
                             device=device)
        model = engine.shard(model, spec, init_on_meta=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return spec, engine, model, opt

    spec, engine, model, opt = build(0)
    n_params = spec.num_params
    from mfsdp_launch.models.llama.dims import resolve_gpt_dims

    ids = torch.randint(0, resolve_gpt_dims(cfg.model).vocab_size, (1, 33), device=device)
    loss = spec.loss(model, {"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    loss.backward()
    opt.step()
    opt.zero_grad()
    pg = dist.new_group(backend="gloo")
    res = {"world": world, "params": n_params, "device": device_type, "torch": torch.__version__}

    def manager(**ck):
        return CheckpointManager(CheckpointConfig(keep_last=10, **ck), workdir, manifest_info=info, rank=rank,
                                 world_size=world, engine=engine, process_group=pg)

    mgr = manager(interval=1)
    res["sync_blocked_s"] = [round(mgr.maybe_save(s, model, opt, None, None), 3) for s in (1, 2)]
    amgr = manager(interval=1, async_save=True)
    first = amgr.maybe_save(3, model, opt, None, None)
    amgr.wait()
    res["async_first_blocked_s"] = round(first, 3)  # allocates the staging buffers
    res["async_blocked_s"] = round(amgr.maybe_save(4, model, opt, None, None), 3)
    t = time.perf_counter()
    # "Training" meanwhile: a few forward/backward passes, then wait for the commit.
    for _ in range(2):
        spec.loss(model, {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}).backward()
        opt.zero_grad()
    res["train_steps_during_async_s"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    amgr.wait()
    res["async_wait_at_end_s"] = round(time.perf_counter() - t, 3)
    res["async_total_s"] = round(amgr.last_save_seconds, 3)
    ck = workdir / "checkpoints" / "step_4"
    res["ckpt_bytes"] = sum(f.stat().st_size for f in ck.iterdir())
    _, engine2, model2, opt2 = build(1)
    engine = engine2
    t = time.perf_counter()
    rmgr = CheckpointManager(CheckpointConfig(), workdir, manifest_info=info, rank=rank, world_size=world,
                             engine=engine2, process_group=pg)
    assert rmgr.resume(model2, opt2, None, None) == 4
    res["load_s"] = round(time.perf_counter() - t, 3)  # includes verifying the checksums
    # The checksum parts alone (page cache warm, as right after a save): what a save adds (each
    # rank hashes what it wrote) and what a resume adds (each rank verifies 1/world of the bytes).
    from mfsdp_launch.checkpoint import find_latest
    from mfsdp_launch.checkpoint.load import verify

    t = time.perf_counter()
    rmgr.saver._checksum_own(ck, pg)
    res["save_checksum_s"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    assert verify(find_latest(workdir / "checkpoints")[0], rmgr.group, rank) is None
    res["resume_verify_s"] = round(time.perf_counter() - t, 3)
    if rank == 0:
        (workdir / "result.json").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--preset", default="125m")
    ap.add_argument("--dir", default="/tmp/bench_ckpt")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args()
    for world in args.world:
        print(f"world {world} ({args.device}) ...", file=sys.stderr, flush=True)
        workdir = Path(args.dir) / f"w{world}"
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        threads = max(1, (os.cpu_count() or 1) // world)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
        procs = [subprocess.Popen([sys.executable, __file__, "--child", str(r), str(world), str(port), str(workdir),
                                   args.preset, args.device], env=env) for r in range(world)]
        codes = [p.wait() for p in procs]
        if any(codes):
            sys.exit(f"world {world}: children exited {codes}")
        res = json.loads((workdir / "result.json").read_text())
        res["omp_threads_per_rank"] = threads
        print(json.dumps(res), flush=True)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5]), sys.argv[6], sys.argv[7])
    else:
        main()
