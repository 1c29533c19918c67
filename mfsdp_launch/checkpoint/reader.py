"""DCP's reader for a committed step directory, on disk or in an object store (core/storage.py).
(Writing needs no choice: DCP takes a URL's checkpoint_id to its fsspec writer by itself.)"""

from __future__ import annotations


def dcp_reader(path):
    """A FileSystemReader for a directory, an FsspecReader for an object-store URL."""
    from ..core import storage

    if storage.is_remote(path):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader(str(path))
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(path))
