"""Where a run's durable files live: a local directory, or an object store (`run.dir=s3://bucket/
path`, `gs://...`, any fsspec URL). One interface, two backends, so the checkpoint protocol,
the metrics and the exports are written once:

* `path(x)`: a `pathlib.Path` for a local path, a `RemotePath` (the pathlib subset those modules
  use: `/`, name, parent, exists, is_dir, is_file, iterdir, read/write, stat, open) for a URL.
* `replace`, `rmtree`, `walk_files`, `listdir`, `atomic_write`, `put_if_absent`, `free_bytes`:
  the operations pathlib lacks, for either.

On an object store a single PUT is atomic (a reader sees the old object or the new one, whole),
so `atomic_write` is one PUT; there are no directories (a prefix is one while objects are under
it: `mkdir` does nothing); a directory "rename" copies each object, then deletes the source.
`put_if_absent` is a conditional PUT (`If-None-Match: *` on S3). Credentials and endpoints come
from the backend's own environment (AWS_* variables or ~/.aws for s3fs, Google's for gcsfs), so
every rank sees the same store. Standard library only until a URL is used (then fsspec).
"""

from __future__ import annotations

import io
import os
import shutil
import time
from pathlib import Path
from typing import Callable, List, Optional, Tuple, Union

from .errors import ConfigError
from .remote_path import RemotePath

# The fsspec backend each common scheme needs (pip name); others are fsspec's business.
BACKENDS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}


def is_remote(p) -> bool:
    """True for a URL other than file:// (an object store)."""
    if isinstance(p, RemotePath):
        return True
    text = str(p)
    return "://" in text and not text.startswith("file://")


def path(p) -> Union[Path, "RemotePath"]:
    """`p` as a Path (local) or a RemotePath (a URL); a Path or RemotePath is returned as it is."""
    if isinstance(p, (Path, RemotePath)):
        return p
    return RemotePath(str(p)) if is_remote(p) else Path(str(p)[len("file://"):] if str(p).startswith("file://") else p)


def replace(src, dst) -> None:
    """os.replace: a file or a directory; on an object store, each object copied, then removed."""
    src, dst = path(src), path(dst)
    if not isinstance(src, RemotePath):
        os.replace(src, dst)
        return
    fs = src.fs
    if fs.isfile(src.key):
        fs.mv(src.key, dst.key)
        return
    files = fs.find(src.key)
    if not files:
        raise FileNotFoundError(str(src))
    fs.copy(files, [dst.key + f[len(src.key):] for f in files])
    fs.rm(files)


def rmtree(p, ignore_errors: bool = False) -> None:
    p = path(p)
    if not isinstance(p, RemotePath):
        shutil.rmtree(p, ignore_errors=ignore_errors)
        return
    try:
        files = p.fs.find(p.key)
        if files:
            p.fs.rm(files)
    except OSError:
        if not ignore_errors:
            raise


def walk_files(root) -> List[Tuple[str, int]]:
    """(path relative to `root`, bytes) of every file under `root`, by path."""
    root = path(root)
    if isinstance(root, RemotePath):
        found = root.fs.find(root.key, detail=True)
        return sorted((name[len(root.key) + 1:], int(info["size"])) for name, info in found.items()
                      if info.get("type") != "directory" and name != root.key)
    out = []
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            p = Path(dirpath) / n
            out.append((p.relative_to(root).as_posix(), p.stat().st_size))
    return sorted(out)


def listdir(p) -> List[str]:
    p = path(p)
    return [c.name for c in p.iterdir()] if isinstance(p, RemotePath) else os.listdir(p)


def atomic_write(final, write_fn: Callable, tmp: Optional[str] = None, mode: Optional[int] = None,
                 sync_dir: bool = False) -> None:
    """core.atomic_io.atomic_write for a local file; one PUT of what `write_fn` wrote for an object."""
    final = path(final)
    if not isinstance(final, RemotePath):
        from .atomic_io import atomic_write as local_write

        local_write(final, write_fn, tmp=tmp, mode=mode, sync_dir=sync_dir)
        return
    buf = io.BytesIO()
    write_fn(buf)
    final.write_bytes(buf.getvalue())


def put_if_absent(p, data: bytes) -> bool:
    """Create `p` holding `data` unless it exists (True when created): O_EXCL locally, a
    conditional PUT on an object store (S3's If-None-Match; a backend without conditional writes
    checks first, which leaves a window of one request)."""
    p = path(p)
    if isinstance(p, RemotePath):
        try:
            p.fs.pipe_file(p.key, data, mode="create")
        except FileExistsError:
            return False
        return True
    try:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return True


def lexists(p) -> bool:
    """os.path.lexists, for either backend."""
    p = path(p)
    return p.exists() if isinstance(p, RemotePath) else os.path.lexists(p)


def copy_file(src, dst) -> None:
    """shutil.copy2 for a file, for either backend (an object's copy is made by the store)."""
    src, dst = path(src), path(dst)
    if isinstance(src, Path) and isinstance(dst, Path):
        shutil.copy2(src, dst)
    elif isinstance(src, RemotePath) and isinstance(dst, RemotePath) and src.protocol == dst.protocol:
        src.fs.copy(src.key, dst.key)
    else:
        dst.write_bytes(src.read_bytes())


class _ObjectAppender:
    """An append-only text object: what was there, plus every write, put again (whole) at most
    every `flush_s` seconds and at close. A crash loses at most the last flush_s of writes."""

    def __init__(self, p: RemotePath, flush_s: float):
        self.path, self.flush_s = p, flush_s
        try:
            self._text = p.read_text()
        except FileNotFoundError:
            self._text = ""
        self._dirty, self._last = False, time.monotonic()

    def write(self, text: str) -> int:
        self._text += text
        self._dirty = True
        if time.monotonic() - self._last >= self.flush_s:
            self.flush()
        return len(text)

    def flush(self) -> None:
        if self._dirty:
            self.path.write_text(self._text)
            self._dirty, self._last = False, time.monotonic()

    def close(self) -> None:
        self.flush()


def open_append(p, flush_s: float = 10.0):
    """A text file opened to append lines: line-buffered locally, an _ObjectAppender on a store."""
    p = path(p)
    return _ObjectAppender(p, flush_s) if isinstance(p, RemotePath) else open(p, "a", buffering=1)


def free_bytes(p) -> Optional[int]:
    """Free space where `p` is (None when unknown: an object store has no such limit)."""
    if is_remote(p):
        return None
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def fsync_dir(p) -> None:
    if not is_remote(p):
        from .atomic_io import fsync_dir as local_fsync

        local_fsync(p)


def check_url(url: str, key: str = "run.dir") -> str:
    """A ConfigError unless `url` names a bucket whose fsspec backend is installed; the URL,
    normalised (no trailing slash)."""
    protocol, _, rest = url.partition("://")
    if not rest.strip("/"):
        raise ConfigError(key, f"{url!r} names no bucket", f"{protocol}://BUCKET/PATH")
    try:
        import fsspec
        from fsspec.registry import known_implementations

        if protocol not in known_implementations and protocol not in fsspec.available_protocols():
            raise ConfigError(key, f"{protocol}:// is not a storage protocol fsspec knows",
                              "a local path, s3://BUCKET/PATH, gs://BUCKET/PATH")
        fsspec.get_filesystem_class(protocol)
    except ImportError:
        pkg = BACKENDS.get(protocol, f"fsspec's {protocol} backend")
        extra = " (pip install 'mfsdp-launch[s3]')" if pkg == "s3fs" else ""
        raise ConfigError(key, f"{protocol}:// needs {pkg}, which is not installed{extra}",
                          "a local path, or install it") from None
    return f"{protocol}://{rest.rstrip('/')}"


def default_local_dir(url: str) -> str:
    """Where a run with an object-store run.dir keeps its logs, STOP file and frozen config on
    this machine when run.local_dir is null: runs/<protocol>/<bucket>/<path>."""
    protocol, _, rest = url.partition("://")
    return os.path.join("runs", protocol, *[p for p in rest.split("/") if p])


def local_run_dir(run_cfg) -> Path:
    """The run's directory on this machine: run.dir, or run.local_dir when run.dir is a URL."""
    if not is_remote(run_cfg.dir):
        return Path(run_cfg.dir)
    return Path(getattr(run_cfg, "local_dir", None) or default_local_dir(str(run_cfg.dir)))
