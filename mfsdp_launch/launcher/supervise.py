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
* What torchrun and the ranks print reaches the console and the logs through launcher/output.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from ..core import rundir
from ..core.process import libc, set_parent_death_signal
from .output import PREFIX_TEMPLATE, Console, Failure, OutputRouter, RankLogLinks, parse_root_cause

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
