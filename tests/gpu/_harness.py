"""Multi-GPU jobs for the GPU tests: one fresh group of processes per job (one per mesh).

A job runs many cases (dicts naming a function of `_jobs.py`, or `module:function` of another job
module, and its arguments) in `world` processes started as plain subprocesses (RANK/WORLD_SIZE/
MASTER_PORT from a free port), so every mesh gets fresh NCCL state (Megatron-FSDP "leaves behind
corrupted NCCL state"). Each rank appends one JSON line per case to its results file; the pytest
process merges them and each parametrized test asserts on its own case's data. Jobs are cached per
pytest session.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
RUNNER = HERE / "_runner.py"
LOG_DIR = Path(os.environ.get("MFSDP_GPU_TEST_LOGS", tempfile.gettempdir())) / "mfsdp_gpu_jobs"

_CACHE: Dict[str, dict] = {}


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def te_available() -> Tuple[bool, str]:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a half-installed TE raises RuntimeError/OSError
        return False, f"Transformer Engine is not usable here: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
    return True, ""


def outer_skip_reason(zero: str, outer, mesh=None, meta: bool = False) -> str:
    """The launcher's own answer (config/sharding.check_sharding, the rule validation applies) for
    this ZeRO stage, outer strategy and mesh: why it is refused, or '' if it runs."""
    from mfsdp_launch.core.sharding import OuterStrategy, ZeroStrategy, check_sharding
    from mfsdp_launch.core.errors import ConfigError

    try:
        check_sharding(ZeroStrategy[zero], OuterStrategy[outer or "no_shard"],
                       dp_outer=mesh[0] if mesh is not None else 2, meta_init=meta)
    except ConfigError as exc:
        return str(exc)
    return ""


def require_gpus(n: int) -> None:
    have = gpu_count()
    if have < n:
        pytest.skip(f"needs {n} GPUs, {have} present")


def require_te() -> None:
    ok, why = te_available()
    if not ok:
        pytest.skip(why)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expert_groups(model):
    """Megatron-FSDP's expert parameter groups and its expert data-parallel process group, read off
    a sharded model (none and None under FSDP2)."""
    buffer = getattr(model, "param_and_grad_buffer", None)
    groups = [g for g in buffer.parameter_groups if g.is_expert_param] if buffer is not None else []
    index = getattr(model, "dist_index", None)
    return groups, (index.get_fsdp_group(is_expert_parallel=True) if index is not None else None)


def fit_one_batch(tr, device, steps: int = 8, each_step=None):
    """`steps` optimizer steps of a built Training (rank/runtime.py) on one fixed batch of 4 x 128
    tokens below 256, so the loss must fall. Returns each step's loss and the last value of
    each_step() (called after every optimizer step), or None."""
    import torch

    fixed = torch.randint(0, 256, (4, 129), generator=torch.Generator().manual_seed(0)).to(device)
    losses, last = [], None
    for _ in range(steps):
        tr.engine.set_grad_sync(tr.model, True)
        loss = tr.spec.loss(tr.forward_model, {"input_ids": fixed[:, :-1], "labels": fixed[:, 1:]})
        loss.backward()
        check = tr.engine.check_step(tr.model, 1.0, loss.detach())
        tr.optimizer.step()
        tr.optimizer.zero_grad()
        if each_step is not None:
            last = each_step()
        losses.append(check.loss)
    return losses, last


def one_rank_script(script: str, case: str, tmp_path: Path, timeout: float = 300) -> dict:
    """Run `python SCRIPT CASE OUT.json` as rank 0 of 1 (a process of its own: a CUDA context and a
    process group per case) and return the JSON it wrote."""
    out = Path(tmp_path) / f"{case}.json"
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()),
               # keep the caller's path too: on the GPU machine megatron-fsdp and hydra live there
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, script, case, str(out)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


class Job:
    """A named set of cases to run in `world` ranks on `mesh` (None: Megatron-FSDP's own mesh)."""

    def __init__(self, name: str, world: int, mesh: Optional[Sequence[int]], timeout: float = 300):
        self.name = name
        self.world = int(world)
        self.mesh = tuple(mesh) if mesh is not None else None
        self.timeout = timeout
        self.cases: List[Tuple[str, dict]] = []

    def add(self, case_id: str, fn: str, **args) -> str:
        self.cases.append((case_id, {"fn": fn, "args": args}))
        return case_id


def run_job(job: Job) -> dict:
    if job.name in _CACHE:
        return _CACHE[job.name]
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix=f"{job.name}-", dir=LOG_DIR))
    spec = {"name": job.name, "mesh": job.mesh, "cases": job.cases, "tmpdir": str(out / "tmp")}
    (out / "tmp").mkdir()
    (out / "spec.json").write_text(json.dumps(spec))
    port = free_port()
    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(job.world),
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "4"))
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    procs = []
    t0 = time.time()
    for rank in range(job.world):
        renv = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
        log = open(out / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(RUNNER), str(out)], env=renv, cwd=str(ROOT),
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log))
    timed_out = False
    failed_at = None
    while True:
        codes = [p.poll() for p, _ in procs]
        if all(c is not None for c in codes):
            break
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = time.time()  # a rank died: its peers may be stuck in a collective
        if failed_at is not None and time.time() - failed_at > 15:
            break
        if time.time() - t0 > job.timeout:
            timed_out = True
            break
        time.sleep(0.5)
    if any(p.poll() is None for p, _ in procs):
        import signal

        for p, _ in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)  # the rank and its compile workers
                except ProcessLookupError:
                    pass
        for p, _ in procs:
            p.wait()
    for _, log in procs:
        log.close()
    codes = [p.returncode for p, _ in procs]
    results: Dict[str, dict] = {}
    for rank in range(job.world):
        path = out / f"results_rank{rank}.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            results.setdefault(row["case"], {})[rank] = row
    tails = {}
    for rank in range(job.world):
        text = (out / f"rank{rank}.log").read_text(errors="replace") if (out / f"rank{rank}.log").exists() else ""
        tails[rank] = "\n".join(text.splitlines()[-40:])
    res = {"results": results, "codes": codes, "timed_out": timed_out, "dir": str(out), "tails": tails,
           "seconds": round(time.time() - t0, 1), "world": job.world}
    print(f"[gpu job {job.name}] world={job.world} mesh={job.mesh} cases={len(job.cases)} "
          f"codes={codes} timed_out={timed_out} {res['seconds']} s logs={out}", flush=True)
    _CACHE[job.name] = res
    return res


def case(job: Job, case_id: str) -> List[dict]:
    """Per-rank data of one case; skips/fails the calling test as the case did."""
    res = run_job(job)
    rows = res["results"].get(case_id)
    if not rows or len(rows) < job.world:
        why = "timed out" if res["timed_out"] else f"exit codes {res['codes']}"
        have = sorted(rows) if rows else []
        pytest.fail(f"case {case_id} did not finish on every rank (ranks with a result: {have}; job {why}; "
                    f"logs {res['dir']})\n" + "\n".join(f"--- rank {r} ---\n{t}" for r, t in res["tails"].items()))
    errors = [(r, row) for r, row in sorted(rows.items()) if row["status"] == "error"]
    if errors:
        pytest.fail("\n".join(f"rank {r}: {row['error']}" for r, row in errors))
    if rows[0]["status"] == "skip":
        pytest.skip(rows[0]["reason"])
    return [rows[r]["data"] for r in range(job.world)]


# A user model whose third forward asks for ~9 TiB: a real CUDA OOM inside the training step
# (test_oom_gpu.py, test_one_gpu_features.py).
OOM_MODULE = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.ff = nn.Linear(dim, dim)

    def forward(self, x):
        return x + self.ff(x)


class LM(nn.Module):
    def __init__(self, vocab=256, dim=64):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab, bias=False)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(2))
        self.calls = 0

    def forward(self, input_ids):
        self.calls += 1
        x = self.emb(input_ids)
        if self.calls == 3:
            x = x + torch.empty(10**13, dtype=torch.uint8, device=x.device).sum()  # ~9 TiB: out of memory
        for block in self.blocks:
            x = block(x)
        return self.head(x)
'''
