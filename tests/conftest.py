"""Hooks for the whole tree: how many xdist workers, and the GPU marker's skip. What tests share
lives in helpers.py."""

from __future__ import annotations

import os

import pytest

# The names conftest used to define, for files that still import them from here
# (unit/bench/test_bench_*.py read ROOT); new code imports from helpers.
from helpers import ROOT, cli, cli_env, free_port  # noqa: F401


def pytest_collection_modifyitems(config, items):
    if _have_cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs (marker gpu); run `python3 -m pytest -m gpu` on a GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _have_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # a broken torch install still lets the CPU tests report
        return False


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): half the cores, at least 2, since most tests spawn 2-4
    processes of their own; 0 (one process) on a GPU machine, where tests would share the GPUs."""
    if _have_cuda():
        return 0
    cores = os.cpu_count() or 1
    return max(2, cores // 2) if cores >= 2 else 0
