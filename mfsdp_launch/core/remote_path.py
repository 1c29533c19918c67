"""The object-store backend of core/storage.py: `RemotePath`, an fsspec location
(`protocol://bucket/key`) with the subset of pathlib's methods the run-dir code uses."""

from __future__ import annotations

import posixpath
from pathlib import PurePosixPath
from types import SimpleNamespace
from typing import List, Optional


def _filesystem(protocol: str):
    import fsspec

    # No listings cache: other ranks and processes write into the same prefixes.
    return fsspec.filesystem(protocol, use_listings_cache=False)


class RemotePath:
    """An object-store location, `protocol://bucket/key`, with the pathlib methods used here."""

    __slots__ = ("protocol", "key", "_fs", "_kind")

    def __init__(self, url: str, *, _fs=None, _kind: Optional[str] = None):
        protocol, _, key = str(url).partition("://")
        self.protocol, self.key = protocol, key.rstrip("/")
        self._fs, self._kind = _fs, _kind  # _kind: "file"/"directory" when a listing said so

    @property
    def fs(self):
        if self._fs is None:
            self._fs = _filesystem(self.protocol)
        return self._fs

    def _child(self, key: str, kind: Optional[str] = None) -> "RemotePath":
        return RemotePath(f"{self.protocol}://{key}", _fs=self._fs, _kind=kind)

    def __str__(self) -> str:
        return f"{self.protocol}://{self.key}"

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, RemotePath) and str(self) == str(other)

    def __lt__(self, other) -> bool:
        return str(self) < str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    def __truediv__(self, part) -> "RemotePath":
        return self._child(posixpath.join(self.key, str(part)))

    @property
    def name(self) -> str:
        return posixpath.basename(self.key)

    @property
    def parent(self) -> "RemotePath":
        return self._child(posixpath.dirname(self.key))

    @property
    def parents(self) -> List["RemotePath"]:
        out, p = [], self
        while "/" in p.key:
            p = p.parent
            out.append(p)
        return out

    def expanduser(self) -> "RemotePath":
        return self

    absolute = resolve = expanduser

    def as_posix(self) -> str:
        return str(self)

    def relative_to(self, other) -> PurePosixPath:
        return PurePosixPath(posixpath.relpath(self.key, RemotePath(str(other)).key))

    def exists(self) -> bool:
        return self._kind is not None or self.fs.exists(self.key)

    def is_dir(self) -> bool:
        return self._kind == "directory" if self._kind else self.fs.isdir(self.key)

    def is_file(self) -> bool:
        return self._kind == "file" if self._kind else self.fs.isfile(self.key)

    def is_symlink(self) -> bool:
        return False

    def iterdir(self) -> List["RemotePath"]:
        try:
            entries = self.fs.ls(self.key, detail=True)
        except FileNotFoundError:
            return []
        return [self._child(e["name"].rstrip("/"), e.get("type")) for e in entries
                if e["name"].rstrip("/") != self.key]

    def stat(self) -> SimpleNamespace:
        return SimpleNamespace(st_size=int(self.fs.size(self.key)))

    def mkdir(self, parents: bool = False, exist_ok: bool = False, mode: int = 0o777) -> None:
        """Nothing to make (a prefix exists while objects are under it); FileExistsError as
        pathlib's when it has objects and exist_ok is false."""
        if not exist_ok and self.exists():
            raise FileExistsError(str(self))

    def open(self, mode: str = "rb", **kw):
        return self.fs.open(self.key, mode, **kw)

    def read_bytes(self) -> bytes:
        return self.fs.cat_file(self.key)

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def write_bytes(self, data: bytes) -> None:
        self.fs.pipe_file(self.key, bytes(data))

    def write_text(self, text: str, encoding: str = "utf-8") -> None:
        self.write_bytes(text.encode(encoding))

    def touch(self) -> None:
        self.write_bytes(b"")

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.key)
        except FileNotFoundError:
            if not missing_ok:
                raise
