"""Run torchrun as the launcher's child, and never leave it behind.

* torchrun runs in its own session (a Ctrl-C on the terminal reaches only the launcher) with a
  parent-death signal (SIGKILL): if the launcher dies, however it dies, torchrun dies with it, and
  the ranks die with torchrun (`stopping.install_process_guards` sets theirs).
* SIGINT, SIGTERM and SIGHUP to the launcher ask for a graceful stop (the STOP file: every rank
  finishes its step, saves a checkpoint and exits); a second one aborts (SIGKILL to torchrun and
  the ranks). The launcher listens from before its `NxM ranks` line: a terminal closed at start-up
  (SIGHUP) is a graceful stop too, and a stop asked before torchrun started starts nothing. Once
  the terminal is gone, the launcher's output goes to /dev/null (the log keeps it all), so it
  still ends with its own exit code. torchrun itself ignores SIGTERM, so a SIGTERM sent to every
  process at once (SLURM preemption, scancel) lets the ranks finish their graceful stop instead of
  torchrun tearing them down with a traceback.
* Ctrl-Z (SIGTSTP) pauses the job, not only the launcher: torchrun and the ranks get SIGSTOP,
  then the launcher stops itself; `fg` (SIGCONT) resumes them all. A pause longer than the
  collectives' timeout (30 min) can end the run when it resumes.
* Output: each rank's stdout/stderr go to files under run.dir/logs (torchrun's --log-dir/--tee)
  and to the console without torchrun's prefix. torchrun's own lines (its ChildFailedError block)
  go to the launcher's log only. A failing rank's traceback is held back and shown once, for the
  rank that failed first, instead of one per rank.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, TextIO

from ..core import rundir
from ..core.console import detach_dead_terminal
from ..core.process import libc, set_parent_death_signal
from ..rank.oom import LINE_RE as OOM_LINE

PREFIX_TEMPLATE = "[rank${rank}]: "  # torchrun's TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE for tee'd lines
_PREFIX = re.compile(r"^\[rank(\d+)\]: ")
_FAILURE_START = re.compile(r"^(mfsdp-train: rank \d+ failed:|Traceback \(most recent call last\):)")
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _torchrun_preexec(launcher_pid: int):
    libc()  # loaded here, in the parent: the child only calls into it

    def setup() -> None:  # runs in the child between fork and exec: no locks, no imports
        set_parent_death_signal(signal.SIGKILL, expected_parent=launcher_pid)
        # SIGTERM to every process at once (SLURM) must reach the ranks' graceful stop, not make
        # torchrun kill them (it handles only the signals in TORCHELASTIC_SIGNALS_TO_HANDLE).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return setup


def torchrun_env(env: dict) -> dict:
    """torchrun's own settings: which signals it turns into a shutdown, and the tee prefix."""
    env = dict(env)
    # Not SIGTERM (ignored, see _torchrun_preexec). Recent torchruns take --signals-to-handle
    # (PET_SIGNALS_TO_HANDLE) and overwrite the older TORCHELASTIC_ variable with its value.
    env["PET_SIGNALS_TO_HANDLE"] = env["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGINT,SIGHUP,SIGQUIT"
    env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = PREFIX_TEMPLATE
    return env


def descendants(pid: int) -> List[int]:
    """Every live descendant of `pid` (Linux /proc), children first."""
    children: Dict[int, List[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _send(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (the ranks are in sessions of their own)."""
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


# --- output -------------------------------------------------------------------------------------


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


# --- running torchrun ---------------------------------------------------------------------------


@dataclass
class Supervised:
    rc: int
    stop_requested: bool = False
    aborted: bool = False
    signals: List[str] = field(default_factory=list)
    root: Optional[Failure] = None
    torchrun_error: Optional[str] = None
    root_oom: bool = False  # the root cause ran out of GPU memory (its one line was shown)


class Supervisor:
    """Created before the launcher's first line: it listens for the stop signals and Ctrl-Z from
    then on, until `restore_signals()` (after the summary line); `run()` starts torchrun."""

    def __init__(self, cmd: List[str], env: dict, run_dir: Path, console: Console, *, pass_fds=(),
                 rank_logs: Optional["RankLogLinks"] = None, progress=None):
        self.cmd, self.env, self.run_dir, self.console = cmd, env, Path(run_dir), console
        self.pass_fds = tuple(pass_fds)
        self.rank_logs = rank_logs
        self.progress = progress  # launcher/progress.py's ProgressBar, or None
        self.proc: Optional[subprocess.Popen] = None
        self.result = Supervised(rc=-1)
        # What the signal handler has to say, printed by the main thread's loop: a handler that
        # wrote itself could land inside the main thread's write to the same stream or log file,
        # and Python raises there ("reentrant call"), ending the launcher with exit 1.
        self._said: List[str] = []
        self._old = {s: signal.signal(s, self._on_signal) for s in FORWARDED}
        self._old[signal.SIGTSTP] = signal.signal(signal.SIGTSTP, self._on_pause)

    def restore_signals(self) -> None:
        """The handlers from before this supervisor (idempotent), and what the last signals said."""
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}
        self.say_pending()

    def _on_pause(self, _signum, _frame) -> None:
        """Ctrl-Z: SIGSTOP to torchrun and the ranks, then to the launcher; SIGCONT (fg, bg)
        continues here and resumes them."""
        job = [self.proc.pid, *descendants(self.proc.pid)] if self.proc is not None and self.proc.poll() is None \
            else []
        for pid in job:
            _send(pid, signal.SIGSTOP)
        self.console.err(f"mfsdp-train: paused (Ctrl-Z): torchrun and {len(job) - 1} rank process(es) stopped "
                         "too; fg resumes them" if job else "mfsdp-train: paused (Ctrl-Z); fg resumes")
        os.kill(os.getpid(), signal.SIGSTOP)  # (SIGTSTP's default could be ignored in an orphaned group)
        for pid in reversed(job):
            _send(pid, signal.SIGCONT)
        if job:
            self.console.log_only("mfsdp-train: resumed (SIGCONT)\n")

    def _on_signal(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        self.result.signals.append(name)
        if len(self.result.signals) == 1:
            self.result.stop_requested = True
            try:
                (self.run_dir / rundir.STOP).touch()
            except OSError:
                pass
            self._said.append(f"mfsdp-train: {name}: finishing the step, saving a checkpoint and stopping "
                              "(signal again to abort)")
        elif not self.result.aborted:
            self.result.aborted = True
            self._said.append(f"mfsdp-train: {name} again: aborting (killing torchrun and the ranks)")
            if self.proc is not None:
                kill_tree(self.proc.pid)

    def say_pending(self) -> None:
        """The signal handler's lines, from the main thread (see __init__)."""
        while self._said:
            self.console.err(self._said.pop(0))

    def run(self) -> Supervised:
        router = OutputRouter(self.console)
        try:
            if self.result.stop_requested:  # asked to stop before anything started: start nothing
                self.say_pending()
                self.result.rc = 0
                return self.result
            if self.progress is not None:
                self.progress.start()  # before the pumps: the lines they print go above the bar
            self.proc = subprocess.Popen(self.cmd, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, start_new_session=True, pass_fds=self.pass_fds,
                                         preexec_fn=_torchrun_preexec(os.getpid()))
            router.start(self.proc)
            self._wait()
        except BaseException:
            if self.proc is not None and self.proc.poll() is None:
                kill_tree(self.proc.pid)  # the launcher itself failed: take the job down with it
            if self.progress is not None:
                self.progress.stop()
            raise
        router.join()
        if self.progress is not None:
            self.progress.stop()
        self.say_pending()
        if self.rank_logs is not None:
            self.rank_logs.link()
        text = "".join(router.torchrun_lines)
        self.result.rc = self.proc.returncode
        self.result.root = parse_root_cause(text)
        if self.result.rc != 0:
            if self.result.root is None and router.first_failing_rank() is not None:
                self.result.root = Failure(rank=router.first_failing_rank())
            router.show_held(self.result.root.rank if self.result.root else None)
            self.result.root_oom = router.root_oom
            self.result.torchrun_error = router.torchrun_error_line()
        else:
            router.show_all_held()
        return self.result

    def _wait(self) -> None:
        while True:
            self.say_pending()
            try:
                self.proc.wait(timeout=0.5)
                return
            except subprocess.TimeoutExpired:
                if self.rank_logs is not None:
                    self.rank_logs.link()
                if self.progress is not None:
                    self.progress.poll()


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
