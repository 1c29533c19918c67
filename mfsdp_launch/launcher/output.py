"""What torchrun and the ranks print, on its way to the console and the logs.

Each rank's stdout/stderr go to files under run.dir/logs (torchrun's --log-dir/--tee) and to the
console without torchrun's prefix; `logs/rank<R>.std{out,err}.log` point at the newest attempt's
files. torchrun's own lines (its ChildFailedError block) go to the launcher's log only. A failing
rank's traceback is held back and shown once, for the rank that failed first, instead of one per
rank. The launcher's own lines go to the terminal while there is one, and always to
logs/launcher.log.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, TextIO

from ..core.console import detach_dead_terminal
from ..rank.oom import LINE_RE as OOM_LINE

PREFIX_TEMPLATE = "[rank${rank}]: "  # torchrun's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE for tee'd lines
_PREFIX = re.compile(r"^\[rank(\d+)\]: ")
_FAILURE_START = re.compile(r"^(mfsdp-train: rank \d+ failed:|Traceback \(most recent call last\):)")


class Console:
    """The launcher's own messages: to the terminal (while there is one) and to logs/launcher.log."""

    def __init__(self, log_path: Optional[Path]):
        self.lock = threading.RLock()  # a signal handler may write while the main thread does
        self.log: Optional[TextIO] = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            self.log = open(log_path, "a", buffering=1, errors="replace")

    def write(self, text: str, stream: TextIO, to_log: bool = True) -> None:
        with self.lock:
            if to_log:
                self.log_only(text)
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError):
                # The terminal went away (SIGHUP) or the reader of a pipe left: the log still gets
                # everything, and what is buffered for the terminal goes to /dev/null.
                detach_dead_terminal()
            except RuntimeError:
                # A signal handler's line while this thread was inside a write to the same stream
                # ("reentrant call inside <_io.BufferedWriter>"): the log has it; the terminal
                # misses one line rather than the launcher failing.
                pass

    def out(self, line: str) -> None:
        self.write(line + "\n", sys.stdout)

    def err(self, line: str) -> None:
        self.write(line + "\n", sys.stderr)

    def log_only(self, text: str) -> None:
        with self.lock:
            if self.log is not None:
                try:
                    self.log.write(text)
                except OSError:  # its disk is full: the console still shows everything
                    self.log = None
                except RuntimeError:  # Ctrl-Z's handler inside this thread's write: one line lost
                    pass

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None


@dataclass
class Failure:
    """What torchrun's summary says about the first rank that failed."""

    rank: Optional[int] = None
    exit_code: Optional[int] = None
    signal_name: Optional[str] = None


def parse_root_cause(torchrun_text: str) -> Optional[Failure]:
    """The 'Root Cause (first observed failure)' entry of torchrun's ChildFailedError block."""
    _, sep, tail = torchrun_text.partition("Root Cause (first observed failure):")
    if not sep:
        return None
    f = Failure()
    m = re.search(r"^\s*rank\s*:\s*(\d+)", tail, re.M)
    f.rank = int(m.group(1)) if m else None
    m = re.search(r"^\s*exitcode\s*:\s*(-?\d+)", tail, re.M)
    f.exit_code = int(m.group(1)) if m else None
    if f.exit_code is not None and f.exit_code < 0:
        try:
            f.signal_name = signal.Signals(-f.exit_code).name
        except ValueError:
            f.signal_name = f"signal {-f.exit_code}"
    return f


class OutputRouter:
    """Reads torchrun's stdout/stderr: rank lines (tee'd with PREFIX_TEMPLATE) to the console,
    unprefixed, everything to the launcher's log, and a rank's traceback held back (see module)."""

    def __init__(self, console: Console):
        self.console = console
        self.lock = threading.Lock()
        self.held: Dict[int, List[str]] = {}  # rank -> its failure block, in the order they began
        self.torchrun_lines: List[str] = []
        self.threads: List[threading.Thread] = []
        self.root_oom = False  # the block shown was an out-of-GPU-memory line

    def start(self, proc: subprocess.Popen) -> None:
        for pipe, err in ((proc.stdout, False), (proc.stderr, True)):
            t = threading.Thread(target=self._pump, args=(pipe, err), daemon=True)
            t.start()
            self.threads.append(t)

    def join(self, timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, end - time.monotonic()))

    def _pump(self, pipe, err: bool) -> None:
        for raw in iter(pipe.readline, b""):
            line = raw.decode(errors="replace")
            if not line.endswith("\n"):
                line += "\n"
            m = _PREFIX.match(line)
            if m is None:
                with self.lock:
                    self.torchrun_lines.append(line)
                self.console.log_only(line)
                continue
            self.console.log_only(line)
            self._rank_line(int(m.group(1)), line[m.end():], err)
        pipe.close()

    def _rank_line(self, rank: int, text: str, err: bool) -> None:
        # The stream is looked up at each line: while the progress bar shows, sys.stdout/stderr
        # print above it.
        if err:
            with self.lock:
                if rank in self.held:
                    self.held[rank].append(text)
                    return
                if _FAILURE_START.match(text) or OOM_LINE.match(text):
                    self.held[rank] = [text]
                    return
        self.console.write(text, sys.stderr if err else sys.stdout, to_log=False)

    def first_failing_rank(self) -> Optional[int]:
        return next(iter(self.held), None)

    def show_held(self, root_rank: Optional[int]) -> None:
        """Show the root cause's traceback; name the other ranks that printed one."""
        if not self.held:
            return
        if root_rank is None:
            root_rank = self.first_failing_rank()
        if root_rank in self.held:  # (a rank killed by a signal printed nothing: the others' errors follow from it)
            block = self.held[root_rank]
            self.root_oom = bool(OOM_LINE.match(block[0]))
            # Out of GPU memory: its one line (rank/oom.py); the traceback stays in logs/rank<N>.stderr.log.
            self.console.write("".join(block[:1] if self.root_oom else block), sys.stderr, to_log=False)
        others = sorted(r for r in self.held if r != root_rank)
        if others:
            self.console.err(f"mfsdp-train: rank(s) {', '.join(map(str, others))} also failed: their tracebacks "
                             "are in logs/rank<N>.stderr.log")

    def show_all_held(self) -> None:
        """A run that finished although ranks printed tracebacks (caught and printed by a library)."""
        for rank, lines in self.held.items():
            self.console.err(f"mfsdp-train: rank {rank} printed on stderr:")
            self.console.write("".join(lines), sys.stderr, to_log=False)

    def torchrun_error_line(self) -> Optional[str]:
        """torchrun's last 'SomeError: message' line (a rendezvous or start-up failure)."""
        for line in reversed(self.torchrun_lines):
            m = re.match(r"^([\w.]*(Error|Exception|Timeout)\w*): (.+)", line.strip())
            if m and "ChildFailedError" not in m.group(1):
                return f"{m.group(1).rsplit('.', 1)[-1]}: {m.group(3)}"
        return None


class RankLogLinks:
    """torchrun writes `<log dir>/<run id>_<random>/attempt_<n>/<local rank>/std{out,err}.log`;
    `logs/rank<R>.std{out,err}.log` point at the newest ones, for people."""

    def __init__(self, logs_dir: Path, torchrun_log_dir: Path, node_rank: int, nproc_per_node: int):
        self.logs_dir, self.base = Path(logs_dir), Path(torchrun_log_dir)
        self.node_rank, self.nproc = node_rank, nproc_per_node
        self.start = time.time()
        self.done: Optional[Path] = None

    def _newest_attempt(self) -> Optional[Path]:
        try:
            attempts = [a for d in self.base.iterdir() if d.is_dir() and d.stat().st_mtime >= self.start - 1
                        for a in d.glob("attempt_*") if a.is_dir()]
        except OSError:
            return None
        return max(attempts, key=lambda a: a.stat().st_mtime, default=None)

    def link(self) -> None:
        attempt = self._newest_attempt()
        if attempt is None or attempt == self.done:
            return
        for local in range(self.nproc):
            rank = self.node_rank * self.nproc + local
            for stream in ("stdout", "stderr"):
                link = self.logs_dir / f"rank{rank}.{stream}.log"
                target = os.path.relpath(attempt / str(local) / f"{stream}.log", self.logs_dir)
                try:
                    tmp = link.with_name(link.name + ".new")
                    tmp.unlink(missing_ok=True)
                    os.symlink(target, tmp)
                    os.replace(tmp, link)
                except OSError:
                    return
        self.done = attempt
