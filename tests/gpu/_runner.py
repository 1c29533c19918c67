"""One rank of a GPU test job (started by _harness.run_job): python _runner.py JOB_DIR."""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))
sys.path.insert(0, str(HERE))


def _jsonable(obj):
    import torch

    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().tolist()
    if isinstance(obj, torch.dtype):
        return str(obj)
    if isinstance(obj, float) and obj != obj:
        return "nan"
    return obj


def main() -> int:
    out = Path(sys.argv[1])
    spec = json.loads((out / "spec.json").read_text())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    import torch
    import torch.distributed as dist

    if os.environ.get("MFSDP_TEST_BACKEND") == "gloo":  # a CPU self-test of this harness
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        dist.init_process_group("nccl", timeout=timedelta(seconds=150), device_id=device)
    import _jobs

    ctx = _jobs.Context(spec["mesh"], rank=rank, world=world, device=device, tmpdir=spec["tmpdir"])
    results = open(out / f"results_rank{rank}.jsonl", "a", buffering=1)
    for case_id, case in spec["cases"]:
        row = {"case": case_id}
        try:
            # "fn" names a function of _jobs.py, or "module:function" of another job module
            module, _, name = case["fn"].rpartition(":")
            data = getattr(importlib.import_module(module) if module else _jobs, name)(ctx, **case["args"])
            row.update(status="ok", data=_jsonable(data))
        except _jobs.Skip as exc:
            row.update(status="skip", reason=str(exc))
        except Exception:  # noqa: BLE001 - reported per case
            row.update(status="error", error=traceback.format_exc()[-6000:])
        results.write(json.dumps(row) + "\n")
        results.flush()
        print(f"[rank {rank}] {case_id}: {row['status']}", flush=True)
        if row["status"] == "error":
            print(row["error"], flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        # Keep the ranks in step between cases (CPU group: never waits on a broken GPU stream).
        # A rank that failed mid-case may have left a peer blocked in a GPU collective: then the
        # barrier times out and this process exits, and the harness ends the job.
        try:
            ctx.barrier(timeout=60 if row["status"] == "error" else 600)
        except Exception as exc:  # noqa: BLE001
            print(f"[rank {rank}] ranks out of step after {case_id} ({type(exc).__name__}); ending the job",
                  flush=True)
            results.close()
            os._exit(3)
    results.close()
    ctx.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
