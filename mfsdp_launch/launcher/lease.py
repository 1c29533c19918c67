"""The run lock of an object-store run.dir (core/storage.py): a lease object, `run.dir/run.lock`.

An object store has no flock and cannot tell whether a process on another machine is alive, so
the lock is a lease: a JSON record (host, pid, command, a token and an expiry time) created with
a conditional put (S3's If-None-Match: a second launch's put fails while the object exists).
The holder renews it every RENEW_S seconds from a thread, pushing its expiry LEASE_S ahead; the
holder deletes it on release. A launch that finds a lease past its expiry (its holder stopped
renewing: killed, its machine lost) takes it over with a warning. Expiry is wall-clock time, so
the machines' clocks must agree to well within LEASE_S (NTP does).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import uuid
from typing import Optional

from ..core import storage
from ..core.console import eprint
from ..core.errors import ConfigError
from .runlock import describe, lock_name

LEASE_S = 120.0
RENEW_S = 30.0


class ObjectLease:
    """`with ObjectLease(url): ...`, as RunLock for a directory. Raises ConfigError when in use."""

    fd = None  # nothing for torchrun to inherit: the lease lives in the store

    def __init__(self, run_dir: str, node_rank: int = 0, command: str = "mfsdp-train", lease_s: float = LEASE_S):
        self.path = storage.path(run_dir) / lock_name(node_rank)
        self.command, self.lease_s = command, lease_s
        self.token = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _record(self) -> bytes:
        return (json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "command": self.command,
                            "argv": sys.argv[1:], "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                            "token": self.token, "expires": time.time() + self.lease_s}) + "\n").encode()

    def _read(self) -> Optional[dict]:
        try:
            record = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def acquire(self) -> "ObjectLease":
        for _ in range(5):
            if storage.put_if_absent(self.path, self._record()):
                self._thread = threading.Thread(target=self._renew, name="run-lease", daemon=True)
                self._thread.start()
                return self
            held = self._read()
            expires = held.get("expires") if held else None
            if held and isinstance(expires, (int, float)) and expires > time.time():
                raise ConfigError("run.dir", f"{self.path.parent} is in use by {describe(held)}: its lease "
                                  f"{self.path} is renewed until {time.strftime('%H:%M:%S', time.localtime(expires))}",
                                  "wait for that run to end, or another run.dir")
            if held:
                eprint(f"mfsdp-train: warning: taking over {self.path} left by {describe(held)}: its lease expired")
            self.path.unlink(missing_ok=True)
        raise ConfigError("run.dir", f"could not take {self.path}: it keeps changing", "try again")

    def _renew(self) -> None:
        while not self._stop.wait(min(RENEW_S, self.lease_s / 4)):
            held = self._read()
            if held is not None and held.get("token") != self.token:
                eprint(f"mfsdp-train: warning: {self.path} was taken over by {describe(held)}")
                return
            try:
                self.path.write_bytes(self._record())
            except OSError as exc:  # the store is unreachable for a while: try again next time
                eprint(f"mfsdp-train: warning: cannot renew {self.path}: {exc}")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
            held = self._read()
            if held is not None and held.get("token") == self.token:
                self.path.unlink(missing_ok=True)

    def __enter__(self) -> "ObjectLease":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
