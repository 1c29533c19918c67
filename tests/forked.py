"""Test processes forked from a server that has imported torch and the launcher once
(multiprocessing's forkserver, one per pytest process, started at the first fork).

A fresh interpreter spends ~7 CPU-s importing torch, FSDP2, dynamo and DCP before a gloo rank does
anything, and ~1 CPU-s importing the launcher before it reads its first override; on a 2-core CI
machine that was most of what these tests cost. A fork of the server is a real process (its own
gloo group, FSDP2, DCP, signals, exit code, output files) that skips only those imports.
Training runs through the CLI still start torchrun and fresh ranks (only the launcher is forked);
helpers.train_ranks forks mfsdp-train's ranks themselves where the CLI around them is not the point.
"""

from __future__ import annotations

import atexit
import locale
import multiprocessing
import multiprocessing.connection
import os
import runpy
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import Optional

# What the children import anyway; a module missing here (an optional extra) is skipped by the server.
PRELOAD = ["torch", "torch.distributed.fsdp", "torch._dynamo", "torch.distributed.checkpoint",
           "torch.distributed.tensor", "transformers.modeling_utils", "mfsdp_launch.launcher.cli",
           "mfsdp_launch.launcher.supervise", "mfsdp_launch.launcher.output", "mfsdp_launch.planner", "mfsdp_launch.rank.worker", "mfsdp_launch.rank.runtime", "mfsdp_launch.rank.loop",
           "helpers", "forked"]

_context = None
# multiprocessing reads a forkserver child's exit code from a pipe, once: a second reader gets EOF
# and reports 255. Process.start() polls every live child (its _cleanup), so a start in one thread
# and a poll in another could both read one child's code; every start and poll takes this lock.
_POLL_LOCK = threading.Lock()


def _server():
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _become(stdout: str, stderr: str, env: dict, cwd: str) -> None:
    """The child's output files, environment and folder, as a fresh process would have them."""
    fd = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.close(fd)
    if stderr == stdout:
        os.dup2(1, 2)
    else:
        fd = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    encoding = locale.getpreferredencoding(False)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))  # read at start-up, which the server has had
    sys.stdout = open(1, "w", encoding=encoding, buffering=1 if unbuffered else -1, closefd=False)
    sys.stderr = open(2, "w", encoding=encoding, errors="backslashreplace", buffering=1, closefd=False)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    # The interpreter puts PYTHONPATH on sys.path at start-up; the server's start-up was not ours.
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    if env.get("OMP_NUM_THREADS"):  # OpenMP read the server's environment when torch loaded
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))


def _exit_like_the_interpreter(code) -> None:
    """What Python does at exit: join threads, run atexit handlers, flush; then exit with `code`."""
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _rank_child(argv, log: str, env: dict, cwd: str) -> None:
    _become(log, log, env, cwd)
    import helpers

    helpers.rank_main(argv)


def _module_child(module: str, args, stdout: str, stderr: str, env: dict, cwd: str) -> None:
    """`python -m MODULE ARGS`, in this fork."""
    _become(stdout, stderr, env, cwd)
    sys.argv = [module, *args]  # runpy sets argv[0] to the module's file, as `python -m` does
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
        code = 1
    _exit_like_the_interpreter(code)


class Forked:
    """A forked child with the parts of subprocess.Popen the tests use."""

    def __init__(self, target, *args):
        self._process = _server().Process(target=target, args=args)
        with _POLL_LOCK:
            self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> Optional[int]:
        return self.poll()

    def poll(self) -> Optional[int]:
        with _POLL_LOCK:
            return self._process.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        multiprocessing.connection.wait([self._process.sentinel], timeout)  # readable once it exits
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self._process.kill()


def rank(argv, log: str, env: dict, cwd: str) -> Forked:
    """A gloo rank child running helpers.rank_main(argv), its output in `log`."""
    return Forked(_rank_child, list(argv), log, env, cwd)


def start_module(module: str, args, *, stdout: str, stderr: str, env: dict, cwd) -> Forked:
    """`python -m MODULE ARGS` started in a fork, its output in the files `stdout` and `stderr`."""
    return Forked(_module_child, module, list(args), stdout, stderr, env, str(cwd))


def run_module(module: str, args, *, cwd, env: dict, timeout: float) -> subprocess.CompletedProcess:
    """subprocess.run([python, -m, module, *args], capture_output=True, text=True), forked."""
    cmd = [sys.executable, "-m", module, *args]
    with tempfile.TemporaryDirectory(prefix="forked") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        child = start_module(module, args, stdout=str(out), stderr=str(err), env=env, cwd=cwd)
        try:
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(errors="replace"),
                                            err.read_text(errors="replace"))
        return subprocess.CompletedProcess(cmd, child.returncode, out.read_text(), err.read_text())
