"""Checkpoints of TE's fused SwiGLU `fc1_weight` under tensor parallelism, in the tp=1 layout.

TE's LayerNormMLP keeps fc1 as one [2*ffn, dim] weight, [gate | up]. Its tp shard on rank r is
[gate_r | up_r]; Megatron-FSDP makes a DTensor whose global rows are the tp shards concatenated,
[gate_0 | up_0 | gate_1 | up_1 | ...], which is not the tp=1 tensor: a checkpoint saved so would
reload at another tp degree with gate and up rows mixed. Megatron-LM splits such weights into
separate keys; here the key and shape stay the tp=1 ones and each rank declares its rows as (at
most) two chunks of the tp=1 tensor, through the hooks DCP asks a tensor for its chunks
(`__create_chunk_list__`, `__create_write_items__`, `__get_tensor_shard__`). DCP then reshards
fc1 between any tp degrees like every other weight. The same applies to its optimizer states.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

GLU_SUFFIXES = ("fc1_weight", "fc1_bias")


def glu_chunks(offset: int, size: int, ffn: int, tp: int) -> List[Tuple[int, int, int]]:
    """(local start, rows, tp=1 row offset) of the rows [offset, offset+size) of the tp-concatenated
    fc1 ([gate_0 | up_0 | gate_1 | up_1 ...], 2*ffn rows) that one rank holds (inside one tp block)."""
    if size == 0:
        return []
    block, half = 2 * ffn // tp, ffn // tp
    r, a = divmod(offset, block)
    if a + size > block:
        raise ValueError(f"rows {offset}..{offset + size} cross a tp block of {block}")
    out = []
    if a < half:  # gate rows
        n = min(a + size, half) - a
        out.append((0, n, r * half + a))
    if a + size > half:  # up rows
        start = max(a, half)
        out.append((start - a, a + size - start, ffn + r * half + (start - half)))
    return out


def glu_to_tp1(full: torch.Tensor, tp: int) -> torch.Tensor:
    """A gathered tp-concatenated fc1 -> the tp=1 [gate | up] rows (for exports)."""
    blocks = [b.chunk(2, dim=0) for b in full.chunk(tp, dim=0)]
    return torch.cat([b[0] for b in blocks] + [b[1] for b in blocks], dim=0)


def canonicalize(dtensor, tp: int) -> None:
    """Declare this rank's fc1 rows of `dtensor` (a Megatron-FSDP DTensor with its uneven chunk
    metadata set) as chunks of the tp=1 tensor, in place."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    local = dtensor._local_tensor
    if getattr(local, "_glu_chunk_list", None) is getattr(local, "__create_chunk_list__", None):
        return  # ours already (Megatron-FSDP's state-dict hooks re-set theirs on every call)
    if local.numel() == 0:
        local.__create_chunk_list__ = local._glu_chunk_list = lambda: []
        local.__create_write_items__ = lambda fqn, tensor: []
        return
    (meta,) = local.__create_chunk_list__()
    if any(meta.offsets[1:]) or tuple(meta.sizes[1:]) != tuple(dtensor.shape[1:]):
        raise ValueError(f"fc1 shard {meta} is not whole rows of {tuple(dtensor.shape)}")
    ffn = dtensor.shape[0] // 2
    pieces = glu_chunks(int(meta.offsets[0]), int(meta.sizes[0]), ffn, tp)
    rest = tuple(meta.sizes[1:])
    chunks = [ChunkStorageMetadata(offsets=torch.Size((off, *[0] * len(rest))), sizes=torch.Size((n, *rest)))
              for _, n, off in pieces]
    views: Dict[Tuple[int, ...], torch.Tensor] = {
        tuple(c.offsets): local.narrow(0, start, n) for c, (start, n, _) in zip(chunks, pieces)}

    def write_items(fqn: str, tensor) -> List[WriteItem]:
        return [WriteItem(type=WriteItemType.SHARD, index=MetadataIndex(fqn, c.offsets),
                          tensor_data=TensorWriteData(chunk=c, properties=TensorProperties.create_from_tensor(local),
                                                      size=tensor.size()))
                for c in chunks]

    local.__create_chunk_list__ = local._glu_chunk_list = lambda: list(chunks)
    local.__create_write_items__ = write_items
    local.__get_tensor_shard__ = lambda index: views[tuple(index.offset)]


def canonicalize_state(model_sd: dict, optimizer, named_params: Dict[int, str], optim_sd, tp: int) -> None:
    """Every fc1 DTensor of a model state dict and of an optimizer state dict (whose state is keyed
    by parameter index, in param_groups order), in place. `named_params`: id(param) -> name."""
    from torch.distributed.tensor import DTensor

    for key, value in model_sd.items():
        if key.endswith(GLU_SUFFIXES) and isinstance(value, DTensor):
            canonicalize(value, tp)
    if optimizer is None or optim_sd is None:
        return
    index, seen = 0, {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in seen:
                continue
            seen[id(p)] = index
            name = named_params.get(id(p)) or named_params.get(id(getattr(p, "orig_param", None)), "")
            if name.endswith(GLU_SUFFIXES):
                for value in optim_sd["state"].get(index, {}).values():
                    if isinstance(value, DTensor) and value.shape == p.shape:
                        canonicalize(value, tp)
            index += 1
