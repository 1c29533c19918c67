"""Load Hugging Face safetensors weights into a model whose parameters may be sharded, each rank
reading only the rows it holds.

The target is a state dict of the live model: plain tensors (a full copy), FSDP2 DTensors
(`Shard(0)` chunks, torch.chunk-sized) or Megatron-FSDP's uneven DTensors (their local tensors
carry the DCP chunk metadata `__create_chunk_list__`). For each tensor the rank's chunk (offsets
and sizes in the global tensor) is intersected with the row segments that fill it
(`llama_keys.sources`, or one whole HF tensor per name for `model=hf`), and only those rows are
read through safetensors' `get_slice(name)[a:b, ...]` (the requested rows' bytes only), with a
handle opened per read so that mapped file pages do not accumulate: a rank's peak host memory is
its shard plus the largest single slice (measured: 2 ranks loading a 1.43 GB fp32 checkpoint into
FSDP2 shards of 713 MiB peaked at 1079 MiB RSS each, 302 MiB of it before the load). Values are written in place into the state dict's tensors, so
for FSDP2 and plain models they land in the parameters directly; `load_into_model` then hands the
state to the engine's `load_state_dict` (Megatron-FSDP copies main weights into compute weights
there).

torch's own `HuggingFaceStorageReader` (torch.distributed.checkpoint) also reads per-chunk slices
and handles DTensors, but only for names that exist 1:1 in the files: it cannot assemble a fused
QKV from three HF tensors, so one reader here serves both cases.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Dict, Iterator, List, Mapping, NamedTuple, Optional, Tuple, Union

from ..core.errors import ConfigError
from .llama.hf_export import INDEX_FILE, SINGLE_FILE
from .llama.hf_keys import Segment, is_ignored
from .lora import base_name

if TYPE_CHECKING:
    import torch


class Stacked(NamedTuple):
    """Where a 3-D tensor [E, rows, ...] comes from when the files hold it as E 2-D tensors: index e
    along dim 0 is filled from `parts[e]`, row segments along dim 1 (HF's per-expert files of a
    fused experts weight: models/hf/moe.py)."""

    parts: Tuple[Tuple[Segment, ...], ...]


# Where one tensor's values are in the files: row segments along its dim 0, or Stacked.
Source = Union[List[Segment], Stacked]


def _segments(source: Source) -> Iterator[Segment]:
    yield from (seg for part in source.parts for seg in part) if isinstance(source, Stacked) else source


@dataclass
class LoadReport:
    """What one rank read: tensors filled, bytes requested from the files, HF tensors unused."""

    tensors: int = 0
    bytes_read: int = 0
    files: int = 0
    unused: List[str] = field(default_factory=list)
    host_rss_before: float = 0.0  # bytes resident when the load began
    host_rss_peak: float = 0.0  # the process's peak resident bytes during the load (Linux VmHWM)


def host_memory() -> Tuple[float, float]:
    """(resident, peak resident) bytes of this process, from /proc/self/status; zeros elsewhere."""
    values = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key, kib = line.split()[:2]
                    values[key] = float(kib) * 1024
    except OSError:
        pass
    return values.get("VmRSS:", 0.0), values.get("VmHWM:", 0.0)


def reset_peak_host_memory() -> None:
    """Restart the kernel's peak-RSS counter (VmHWM) at the current RSS, so the peak seen after a
    load is the load's own, not start-up's; a no-op where /proc/self/clear_refs is missing."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def file_shapes(files: Mapping[str, Path]) -> Dict[str, Tuple[int, ...]]:
    """{HF tensor name: shape} of every tensor in `files`, read from the file headers only."""
    from safetensors import safe_open

    shapes: Dict[str, Tuple[int, ...]] = {}
    for path in sorted(set(files.values())):
        with safe_open(str(path), framework="pt") as f:
            shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    return shapes


def weight_files(hf_dir: str | Path, *, key: str) -> Dict[str, Path]:
    """{HF tensor name: safetensors file}: the single model.safetensors if present (as
    transformers prefers it), else the shards its index names."""
    from safetensors import safe_open

    d = Path(hf_dir).expanduser()
    single, index = d / SINGLE_FILE, d / INDEX_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: single for name in f.keys()}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(key, f"{index} is not a safetensors index ({type(exc).__name__}: {exc})") from exc
        files = {name: d / file for name, file in weight_map.items()}
        missing = sorted({p.name for p in files.values() if not p.is_file()})
        if missing:
            raise ConfigError(key, f"{index} names {missing[0]}, which is missing")
        return files
    hint = " (only PyTorch .bin weights: convert them to safetensors)" if any(d.glob("*.bin")) else ""
    raise ConfigError(key, f"{d} has no {SINGLE_FILE} or {INDEX_FILE}{hint}")


def local_chunk(t: "torch.Tensor") -> Tuple["torch.Tensor", Tuple[int, ...], Tuple[int, ...]]:
    """(local tensor, global offsets, local sizes) of a plain tensor or a DTensor."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t, (0,) * t.ndim, tuple(t.shape)
    local = t._local_tensor
    chunks = getattr(local, "__create_chunk_list__", None)
    if chunks is not None:  # Megatron-FSDP's uneven shards
        chunk = chunks()
        if not chunk:
            return local, (0,) * t.ndim, (0,) * t.ndim
        return local, tuple(chunk[0].offsets), tuple(chunk[0].sizes)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return local, tuple(offsets), tuple(shape)


def _alias_groups(state: Mapping[str, "torch.Tensor"]) -> Dict[str, str]:
    """{name: first name} for entries that are the same storage (tied weights)."""
    seen: Dict[Tuple, str] = {}
    first: Dict[str, str] = {}
    for name, t in state.items():
        local = local_chunk(t)[0]
        ident = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape)) \
            if local.numel() else ("empty", id(t))
        first[name] = seen.setdefault(ident, name)
    return first


class _Files:
    """Reads row slices through safetensors, one short-lived handle per read, and counts bytes.

    A handle memory-maps its file and the pages a read touches stay in the process's RSS until
    the handle closes; closing after each read keeps the host footprint near the shard being
    filled instead of growing to every byte this rank reads.
    """

    def __init__(self, files: Mapping[str, Path]):
        self.files, self.bytes_read, self.opened = files, 0, set()
        self.shapes: Dict[str, Tuple[int, ...]] = {}

    def shape(self, name: str) -> Tuple[int, ...]:
        if name not in self.shapes:
            from safetensors import safe_open

            path = self.files[name]
            with safe_open(str(path), framework="pt") as f:  # the header only: all shapes at once
                for other in f.keys():
                    self.shapes[other] = tuple(f.get_slice(other).get_shape())
        return self.shapes[name]

    def read(self, name: str, index) -> "torch.Tensor":
        from safetensors import safe_open

        path = self.files[name]
        with safe_open(str(path), framework="pt") as f:
            t = f.get_slice(name)[index]
        self.opened.add(path)
        self.bytes_read += t.numel() * t.element_size()
        return t


def check_source(name: str, shape: Tuple[int, ...], source: Source, shape_of, where, key: str,
                 extents: Optional[Mapping[str, int]] = None) -> None:
    """ConfigError under `key` unless the files hold `source` for a tensor `name` of `shape`:
    `shape_of(hf_name)` (None when absent) and `where(hf_name)` (its file, for the message) read the
    files; `extents`: the rows each HF tensor must have (default: what `source` reads of it)."""
    if isinstance(source, Stacked) and len(source.parts) != shape[0]:
        raise ConfigError(key, f"the HF weights hold {len(source.parts)} parts of {name}, which has {shape[0]}")
    inner = shape[1:] if isinstance(source, Stacked) else shape
    for e, part in enumerate(source.parts if isinstance(source, Stacked) else ()):
        rows = sum(seg.rows for seg in part)
        if rows != inner[0] and all(shape_of(seg.hf_name) for seg in part):
            names = " + ".join(seg.hf_name for seg in part)
            raise ConfigError(key, f"{names} hold {rows} rows in {where(part[0].hf_name)}, "
                                   f"{name}[{e}] needs {inner[0]}")
    for seg in _segments(source):
        hf_shape = shape_of(seg.hf_name)
        if hf_shape is None:
            raise ConfigError(key, f"the HF weights have no {seg.hf_name} (needed for {name})")
        rows = extents[seg.hf_name] if extents else seg.hf_row + seg.rows
        want = (rows, *inner[1:]) if inner else ()
        if hf_shape != want:
            who = "the model" if seg.hf_name == name else name
            raise ConfigError(key, f"{seg.hf_name} has shape {list(hf_shape)} in {where(seg.hf_name)}, "
                                   f"{who} needs {list(want)}")


def _fill(t: "torch.Tensor", source: Source, files: _Files) -> None:
    """Copy this rank's part of `t` from the HF tensors that hold it."""
    local, offsets, sizes = local_chunk(t)
    if local.numel() == 0:
        return
    if local.ndim == 0:
        local.copy_(files.read(source[0].hf_name, ()))
        return
    local = local.view(sizes)
    if isinstance(source, Stacked):  # one HF tensor group per index along dim 0
        for i in range(sizes[0]):
            _fill_rows(local[i], offsets[1:], sizes[1:], source.parts[offsets[0] + i], files)
        return
    _fill_rows(local, offsets, sizes, source, files)


def _fill_rows(local: "torch.Tensor", offsets, sizes, segments, files: _Files) -> None:
    """Rows offsets[0]..+sizes[0] (the rest of the dims sliced by offsets[1:]) from the row
    segments that intersect them."""
    r0, r1 = offsets[0], offsets[0] + sizes[0]
    rest = tuple(slice(o, o + s) for o, s in zip(offsets[1:], sizes[1:]))
    row = 0
    for seg in segments:
        a, b = max(r0, row), min(r1, row + seg.rows)
        if a < b:
            piece = files.read(seg.hf_name, (slice(seg.hf_row + a - row, seg.hf_row + b - row), *rest))
            local[a - r0:b - r0].copy_(piece)
        row += seg.rows


def load_hf_weights(state: Mapping[str, "torch.Tensor"], hf_dir: str | Path, *,
                    sources: Optional[Mapping[str, List[Segment]]] = None,
                    renamed: Optional[Mapping[str, Source]] = None,
                    key: str = "model.init_from") -> LoadReport:
    """Fill `state` ({name: tensor or DTensor}; wrapper prefixes allowed) in place from the
    safetensors in `hf_dir`, reading only each rank's rows.

    `sources`: {unwrapped name: row segments} (`llama_keys.sources(dims, model)`), or None when
    the names are HF's own (`model=hf`; then `renamed` gives the sources of the names the files
    hold in another layout: models/hf/moe.py's per-expert files); LoRA adapters are left out
    (models/lora.py: base_name). Tied entries (one storage under two names) are filled once, from
    whichever name the files hold; TE `_extra_state` entries are skipped. Anything missing or of
    the wrong shape is one ConfigError under `key`. Not a collective.
    """
    import torch

    from ..engines.base import strip_prefixes

    files_map = weight_files(hf_dir, key=key)
    # Under LoRA (models/lora.py) the adapted layers' weights load by the base's names, and the
    # adapters (not in the files) keep their init.
    named = {k: base_name(strip_prefixes(k)) for k in state}
    targets = {named[k]: v for k, v in state.items()
               if isinstance(v, torch.Tensor) and not is_ignored(k) and named[k] is not None}
    if sources is None:
        renamed = {k: v for k, v in (renamed or {}).items() if k not in files_map}
        sources = {k: renamed.get(k) or [Segment(k, 0, v.shape[0] if v.ndim else 1)] for k, v in targets.items()}
    first = _alias_groups(targets)
    report = LoadReport()
    used = set()
    with torch.no_grad():
        files = _Files(files_map)
        unmapped = [n for n in targets if n not in sources] + [n for n in sources if n not in targets]
        if unmapped:  # the model and the mapping (its dims) disagree
            raise ConfigError(key, f"the model and the HF mapping differ on {unmapped[0]}")
        plan = {name: sources[name] for name in targets}
        extents: Dict[str, int] = {}
        for source in plan.values():
            for s in _segments(source):
                extents[s.hf_name] = max(extents.get(s.hf_name, 0), s.hf_row + s.rows)
        groups: Dict[str, List[str]] = {}
        for name in plan:
            groups.setdefault(first[name], []).append(name)
        for names in groups.values():
            held = [n for n in names if all(s.hf_name in files_map for s in _segments(plan[n]))]
            name = (held or names)[0]  # a tied group is filled once, through a name the files hold
            check_source(name, tuple(targets[name].shape), plan[name],
                         lambda n: files.shape(n) if n in files_map else None, lambda n: files_map[n].name, key, extents)
            _fill(targets[name], plan[name], files)
            used.update(s.hf_name for s in _segments(plan[name]))
            report.tensors += 1
        report.bytes_read = files.bytes_read
        report.files = len(files.opened)
    report.unused = sorted(n for n in files_map if n not in used)
    return report


def load_into_model(model, hf_dir: str | Path, *, engine=None,
                    sources: Optional[Mapping[str, List[Segment]]] = None,
                    renamed: Optional[Mapping[str, Source]] = None,
                    key: str = "model.init_from") -> LoadReport:
    """Load HF weights into a (possibly sharded) model: through `engine.state_dict` /
    `engine.load_state_dict` when an engine is given (a collective then), else the plain
    `model.state_dict()`, whose tensors share the parameters' storage."""
    reset_peak_host_memory()
    before = host_memory()[0]
    if engine is None:
        report = load_hf_weights(model.state_dict(), hf_dir, sources=sources, renamed=renamed, key=key)
    else:
        state = engine.state_dict(model, None)
        report = load_hf_weights(state["model"], hf_dir, sources=sources, renamed=renamed, key=key)
        engine.load_state_dict(model, None, state)
    report.host_rss_before, report.host_rss_peak = before, max(before, host_memory()[1])
    return report


def announce(report: LoadReport, *, key: str, source: str) -> None:
    """One line on rank 0: what rank 0 read, and every rank's host memory during the load (the
    peak per rank is what must stay near a rank's shard). A collective when distributed."""
    import torch.distributed as dist

    mine = (report.host_rss_before, report.host_rss_peak)
    ranks = [mine]
    if dist.is_initialized():
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        if dist.get_rank() != 0:
            return
    gib = 2**30
    peaks = [p for _, p in ranks]
    print(f"{key}: {describe(report)} (rank 0) from {source}; host RSS peak per rank during the load "
          f"{min(peaks) / gib:.2f}-{max(peaks) / gib:.2f} GiB (from {min(b for b, _ in ranks) / gib:.2f}-"
          f"{max(b for b, _ in ranks) / gib:.2f} GiB before it)", flush=True)


def describe(report: LoadReport) -> str:
    return (f"loaded {report.tensors} tensors, read {report.bytes_read / 2**20:.1f} MiB from "
            f"{report.files} file(s)" + (f"; unused in the files: {report.unused[:4]}" if report.unused else ""))

