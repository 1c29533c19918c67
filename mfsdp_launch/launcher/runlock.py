"""One owner per run directory: `run.dir/run.lock`, taken before anything is written there.

The lock is an `flock` on the lock file, so the kernel drops it when its holder dies, however it
dies; the file also records who holds it (host, pid, start time, command) so that a refused
launch can name the holder, and so that a lock file left by a dead process is recognised as stale
and taken over with a warning. On a filesystem without `flock` the record alone decides (a file
created with O_EXCL; a record of a live process, or of a process on another host, refuses).

The holder unlinks the file when it releases it, so a run.lock left in a run dir means a launcher
that died (killed, or its machine lost).

Standard library only (the launcher imports it before torch).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from ..core import rundir
from ..core.console import eprint
from ..core.errors import ConfigError

_NO_FLOCK = (errno.ENOLCK, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP)


def check_run_dir(value) -> Path:
    """The absolute run dir for `run.dir`'s value (`~` expanded), or ConfigError when it is empty
    or cannot be a directory we write to. Creates nothing."""
    text = "" if value is None else str(value).strip()
    if not text:
        raise ConfigError("run.dir", "is empty", "a directory path, e.g. run.dir=runs/my_run")
    path = Path(os.path.abspath(os.path.expanduser(text)))
    if path.exists() and not path.is_dir():
        raise ConfigError("run.dir", f"{path} exists and is not a directory", "a directory path")
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError("run.dir", f"cannot create {path}: {probe} is not a directory", "a directory path")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError("run.dir", f"{probe} is not writable", "a directory this user can write")
    return path


def lock_name(node_rank: int = 0) -> str:
    """Node 0 holds `run.lock`; the other nodes of a multi-node job share the run dir and each hold
    their own (`run.lock.node<N>`), so two jobs still cannot start the same node twice."""
    return rundir.LOCK if not node_rank else f"{rundir.LOCK}.node{node_rank}"


def _start_ticks(pid: int) -> Optional[int]:
    """The process's start time (clock ticks since boot): tells a live holder from a reused pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int, start_ticks: Optional[int]) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now = _start_ticks(pid)
    return start_ticks is None or now is None or now == start_ticks


def describe(record: Optional[dict]) -> str:
    if not record:
        return "another process (its record is not written yet)"
    what = f"pid {record.get('pid')} on host {record.get('host')}"
    if record.get("started"):
        what += f" since {record['started']}"
    command = str(record.get("command") or "")
    if command:
        what += f" ({command if len(command) <= 100 else command[:97] + '...'})"
    return what


class RunLock:
    """`with RunLock(run_dir): ...` creates run_dir, takes its lock, and releases it on exit.

    Raises ConfigError (exit code 2) when run_dir cannot be created or written, or is in use."""

    def __init__(self, run_dir, node_rank: int = 0, command: str = "mfsdp-train"):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / lock_name(node_rank)
        self.command = command
        self.fd: Optional[int] = None
        self.flock = True

    # -- taking it ---------------------------------------------------------------------------

    def acquire(self) -> "RunLock":
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError("run.dir", f"cannot create {self.run_dir}: {exc.strerror or exc}",
                              "a directory this user can write") from None
        for _ in range(20):  # a holder releasing while we look: look again
            fd = self._open()
            if not self._lock(fd):
                fd = self._create_exclusive(fd)
            if fd is not None and self._same_file(fd):
                self.fd = fd
                self._take_over(self._read(fd))
                self._write_record()
                return self
            if fd is not None:
                os.close(fd)
            time.sleep(0.05)
        raise ConfigError("run.dir", f"could not take {self.path}: it keeps changing", "try again")

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ConfigError("run.dir", f"{self.run_dir} is not writable ({exc.strerror or exc})",
                              "a directory this user can write") from None

    def _lock(self, fd: int) -> bool:
        """True when we hold the flock, False when the filesystem has none; ConfigError when held."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            holder = self._read(fd)
            for _ in range(20):  # taken an instant ago: its holder is writing its record
                if holder:
                    break
                time.sleep(0.05)
                holder = self._read(fd)
            os.close(fd)
            raise ConfigError("run.dir", f"{self.run_dir} is in use by {describe(holder)}: {self.path} is held",
                              "wait for that run to end, or another run.dir") from None
        except OSError as exc:
            if exc.errno not in _NO_FLOCK:
                raise
            self.flock = False  # e.g. a cluster filesystem mounted without flock: the record decides
            return False

    def _create_exclusive(self, fd: int) -> Optional[int]:
        """Without flock: own the file by creating it (O_EXCL), after judging the record of an
        existing one (a live or unknowable holder refuses; a dead one's file is removed)."""
        record = self._read(fd)
        os.close(fd)
        if record:
            self._take_over(record)  # raises unless its holder is gone
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileExistsError:
            return None  # another launch created it first (or is still writing its record): look again

    def _same_file(self, fd: int) -> bool:
        """The path still names the file we locked (its holder may have unlinked it meanwhile)."""
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    @staticmethod
    def _read(fd: int) -> Optional[dict]:
        try:
            data = os.pread(fd, 65536, 0)
            record = json.loads(data.decode()) if data.strip() else None
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def _take_over(self, record: Optional[dict]) -> None:
        """A record left in a lock nobody holds: its writer died without releasing it."""
        if not record or record.get("pid") == os.getpid():
            return
        here = record.get("host") == socket.gethostname()
        pid = record.get("pid")
        if here and isinstance(pid, int) and _alive(pid, record.get("start_ticks")):
            self._give_up()
            raise ConfigError("run.dir", f"{self.run_dir} is in use by {describe(record)} (its lock file "
                              f"{self.path} is not flock-able here, but that process is alive)",
                              "wait for that run to end, or another run.dir")
        if not here and not self.flock:
            self._give_up()
            raise ConfigError("run.dir", f"{self.run_dir} may be in use by {describe(record)}: this filesystem "
                              f"cannot lock {self.path}, and a process on another host cannot be checked",
                              f"remove {self.path} if that run is over, or another run.dir")
        why = "no longer running" if here else "its lock is not held any more"
        eprint(f"mfsdp-train: warning: taking over {self.path} left by {describe(record)}: {why}")

    def _give_up(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _write_record(self) -> None:
        record = {"host": socket.gethostname(), "pid": os.getpid(), "start_ticks": _start_ticks(os.getpid()),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "command": self.command,
                  "argv": sys.argv[1:]}
        data = (json.dumps(record) + "\n").encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)
        os.fsync(self.fd)

    # -- giving it back ----------------------------------------------------------------------

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if self._same_file(self.fd):
                os.unlink(self.path)  # while still holding it: nobody can take a lock on a file going away
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
