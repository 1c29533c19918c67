"""Shared test helpers: free ports, the CLI as a subprocess, and the GPU marker's skip."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env() -> dict:
    """The environment of a user's shell running this checkout's CLI."""
    # A user's shell is not inside a job: drop any rank/entry.pyrendezvous variables the test process has.
    env = {k: v for k, v in os.environ.items() if k not in DIST_VARS and not k.startswith("SLURM_")
           and not k.startswith("TORCHELASTIC_")}
    env.setdefault("MFSDP_CACHE_DIR", str(ROOT / ".pytest_cache" / "tokens"))
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def cli(*args: str, cwd=None, timeout: float = 600, env=None) -> subprocess.CompletedProcess:
    """Run `python -m mfsdp_launch ARGS` the way a user would, capturing its output."""
    full_env = cli_env()
    if env:
        full_env.update(env)
    return subprocess.run([sys.executable, "-m", "mfsdp_launch", *args], cwd=cwd or ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        have_cuda = torch.cuda.is_available()
    except Exception:  # a broken torch install still lets the CPU tests report
        have_cuda = False
    if have_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs (marker gpu); run `python3 -m pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
