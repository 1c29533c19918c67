"""Hooks for the whole tree: the GPU marker's skip. What tests share lives in helpers.py."""

from __future__ import annotations

import pytest

# The names conftest used to define, for files that still import them from here
# (unit/bench/test_bench_*.py read ROOT); new code imports from helpers.
from helpers import ROOT, cli, cli_env, free_port  # noqa: F401


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
