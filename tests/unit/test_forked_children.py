"""The tests' forked children (tests/forked.py) report their own exit codes when many are started
and awaited from threads at once, as the golden-output test does."""

import os
from concurrent.futures import ThreadPoolExecutor

import forked


def _start_and_wait(code: int) -> int:
    return forked.Forked(os._exit, code).wait(60)


def test_exit_codes_survive_concurrent_starts_and_waits():
    # Unlocked, multiprocessing's poll in one thread's start() stole another child's code about once
    # in 200 children here (it then reads EOF and reports 255).
    codes = [2 + i % 5 for i in range(400)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        assert list(pool.map(_start_and_wait, codes)) == codes
