"""The few collectives the checkpoint protocol needs, on a CPU (gloo) process group; each a no-op
in a single process. Every rank must call them in the same order."""

from __future__ import annotations


class Group:
    def __init__(self, process_group, world_size: int):
        import torch.distributed as dist

        self.pg = process_group
        self.world_size = int(world_size)
        self.distributed = dist.is_available() and dist.is_initialized()

    @property
    def active(self) -> bool:
        return self.distributed and self.world_size > 1

    def gather(self, obj) -> list:
        """Every rank's `obj`, by rank (an all_gather: it doubles as a barrier)."""
        if not self.active:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def barrier(self) -> None:
        self.gather(None)

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if not self.active:
            return obj
        import torch.distributed as dist

        box = [obj]
        src = dist.get_global_rank(self.pg, 0) if self.pg is not None else 0
        dist.broadcast_object_list(box, src=src, group=self.pg)
        return box[0]

    def rank_in(self, process_group) -> int:
        """This process's rank in `process_group` (DCP names its files by it)."""
        if not self.distributed:
            return 0
        import torch.distributed as dist

        return dist.get_rank(process_group)
