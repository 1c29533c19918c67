"""What a ``data.sources[i].path`` names, and the cheap checks the launcher runs before spawning.

A path (``~`` expanded) is one of:

* a directory with ``manifest.json`` (``mfsdp-data prepare`` output);
* a Megatron indexed dataset: ``PREFIX``, ``PREFIX.bin`` or ``PREFIX.idx`` with both files present;
* a flat ``.bin`` without ``.idx`` beside it (nanoGPT uint16, or llm.c with its header);
* a glob of these (``**`` allowed); other files it matches are ignored. Matches are sorted.

Checks read manifests and headers only (no token data, no document scan), so they take
milliseconds, and each problem is one ``ConfigError`` line naming the key.
"""

from __future__ import annotations

import glob as _glob
import os
from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence, Tuple

from ..core.schema import Pack
from ..core.errors import ConfigError
from . import shards as _shards
from .formats import FlatShard
from .indexed import MegatronShard, Shard
from ..core.names import first_line

ALLOWED = ("a prepared directory (manifest.json), a Megatron PREFIX with .bin/.idx, "
           "a nanoGPT/llm.c .bin, or a glob of these")
PACKS = tuple(p.value for p in Pack)  # data.pack, as the config schema spells it


@dataclass
class Source:
    spec: str
    weight: float = 1.0
    shards: List[Shard] = field(default_factory=list)
    kinds: List[str] = field(default_factory=list)
    vocab_size: Optional[int] = None  # None: not recorded (Megatron, flat)
    tokenizer_sha256: Optional[str] = None
    eos_id: Optional[int] = None
    loss_mask: Optional[dict] = None  # chat data: the manifest's loss_mask (train_on, template)
    n_targets: int = 0  # chat data: tokens its loss mask trains on

    @property
    def has_mask(self) -> bool:
        return any(s.mask_path is not None for s in self.shards)

    @property
    def n_tokens(self) -> int:
        return sum(s.n_tokens for s in self.shards)


def _entry(path: str) -> Optional[Tuple[str, str]]:
    """(kind, path or prefix) of one filesystem path, None when it is no known corpus."""
    if os.path.isdir(path):
        return ("prepared", path) if os.path.isfile(os.path.join(path, _shards.MANIFEST)) else None
    stem, ext = os.path.splitext(path)
    if ext in (".bin", ".idx") and os.path.isfile(stem + ".bin") and os.path.isfile(stem + ".idx"):
        return "megatron", stem
    if ext == ".bin" and os.path.isfile(path):
        return "flat", path
    if not ext and os.path.isfile(path + ".bin") and os.path.isfile(path + ".idx"):
        return "megatron", path
    return None


def _entries(spec: str, key: str) -> List[Tuple[str, str]]:
    p = os.path.expanduser(str(spec))
    if os.path.exists(p) or os.path.exists(p + ".bin"):
        e = _entry(p)
        if e is None:
            what = "a directory without manifest.json" if os.path.isdir(p) else "not a known format"
            raise ConfigError(key, f"{spec!r} is {what}", ALLOWED)
        return [e]
    matches = sorted(_glob.glob(p, recursive=True))
    if not matches:
        raise ConfigError(key, f"{spec!r} does not exist", ALLOWED)
    found = sorted({e for e in map(_entry, matches) if e is not None}, key=lambda e: e[1])
    if not found:
        raise ConfigError(key, f"{spec!r} matches {len(matches)} path(s) but no corpus", ALLOWED)
    return found


def resolve(spec: str, *, key: str, eos_id: Optional[int] = None, cache_dir: Optional[str] = None) -> Source:
    """Open (lazily) every shard ``spec`` names. ``eos_id`` splits flat files into documents."""
    src = Source(str(spec))
    for kind, path in _entries(spec, key):
        try:
            if kind == "prepared":
                m, shard_list = _shards.open_prepared(path)
                src.shards += shard_list
                tok = m["tokenizer"]
                if src.tokenizer_sha256 not in (None, tok["sha256"]):
                    raise ConfigError(key, f"{path} was tokenized with another tokenizer than the rest "
                                      f"of {spec!r}")
                src.tokenizer_sha256, src.eos_id = tok["sha256"], m["eos_id"]
                if m.get("loss_mask"):
                    src.loss_mask = dict(m["loss_mask"])
                    src.n_targets += int(m.get("n_targets", 0))
                src.vocab_size = max(src.vocab_size or 0, int(tok["vocab_size"]))
            elif kind == "megatron":
                src.shards.append(MegatronShard(path))
            else:
                src.shards.append(FlatShard(path, eos_id, cache_dir))
        except (ValueError, OSError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(key, first_line(e, type(e).__name__)) from None
        src.kinds.append(kind)
    return src


def _get(entry: Any, name: str, default: Any = None) -> Any:
    if isinstance(entry, str):
        return entry if name == "path" else default
    if hasattr(entry, "get"):
        return entry.get(name, default)
    return getattr(entry, name, default)


def entry_path(entry: Any) -> Any:
    """The path of a ``data.sources`` entry (``{path, weight}`` or a bare path)."""
    return _get(entry, "path")


def _weight(entry: Any, key: str) -> float:
    w = _get(entry, "weight", 1.0)
    try:
        w = float(1.0 if w is None else w)
    except (TypeError, ValueError):
        raise ConfigError(key, f"{w!r} is not a number", "a number > 0") from None
    if not w > 0 or w == float("inf"):
        raise ConfigError(key, f"{w} must be > 0 and finite", "a number > 0")
    return w


def check_sources(sources: Sequence[Any], *, key: str = "data.sources", seq_len: Optional[int] = None,
                  model_vocab: Optional[int] = None, pack: str = "windows", val_fraction: float = 0.0,
                  eos_id: Optional[int] = None) -> List[Source]:
    """Validate ``sources`` (``[{path, weight}]`` or paths) cheaply; the first problem is a ConfigError.

    ``seq_len`` and ``model_vocab`` are checked when given. Returns the sources with lazily
    opened shards (flat files not yet split at EOS).
    """
    if pack not in PACKS:
        raise ConfigError("data.pack", f"unknown {pack!r}", PACKS)
    if not 0.0 <= float(val_fraction) < 1.0:
        raise ConfigError("data.val_fraction", f"{val_fraction} is outside [0, 1)")
    if not sources:
        raise ConfigError(key, "is empty", "a list of {path, weight}")
    out: List[Source] = []
    need = None if seq_len is None else int(seq_len) + 1
    for i, entry in enumerate(sources):
        k = f"{key}[{i}]"
        path = _get(entry, "path")
        if not path:
            raise ConfigError(f"{k}.path", "is missing", ALLOWED)
        src = resolve(path, key=f"{k}.path")
        src.weight = _weight(entry, f"{k}.weight")
        n = src.n_tokens
        if n == 0:
            raise ConfigError(f"{k}.path", f"{path!r} holds no tokens")
        if need is not None and n * (1.0 - float(val_fraction)) < need:
            raise ConfigError(f"{k}.path", f"{path!r} has {n} tokens, too few for samples of "
                              f"train.seq_len + 1 = {need}" + (f" with data.val_fraction={val_fraction}"
                                                                  if val_fraction else ""))
        if need is not None and val_fraction and n * float(val_fraction) < need:
            raise ConfigError("data.val_fraction", f"{val_fraction} of {path!r} ({n} tokens) is fewer "
                              f"than train.seq_len + 1 = {need} tokens")
        if model_vocab is not None and src.vocab_size is not None and src.vocab_size > int(model_vocab):
            raise ConfigError("model.vocab_size", f"{model_vocab} is smaller than the vocab "
                              f"{src.vocab_size} of {k} ({path!r})")
        if pack == "documents" and "flat" in src.kinds and eos_id is None:
            raise ConfigError("data.pack", f"documents needs document boundaries, but {k} ({path!r}) is a "
                              f"flat .bin; set data.eos_id to split it", ("windows", "documents with data.eos_id"))
        if out and None not in (out[0].tokenizer_sha256, src.tokenizer_sha256) \
                and src.tokenizer_sha256 != out[0].tokenizer_sha256:
            raise ConfigError(f"{k}.path", f"{path!r} was tokenized with another tokenizer than {key}[0]")
        out.append(src)
    return out


def check_integrity(sources: Sequence[Any], *, key: str = "data.sources") -> None:
    """Sizes and sampled checksums (shards.check_sampled) of every prepared directory that
    ``sources`` name; a ConfigError naming the first damaged file. Megatron and flat files have
    no manifest, so nothing to check them against. Run by the launcher before spawning."""
    for i, entry in enumerate(sources):
        k = f"{key}[{i}].path"
        for kind, path in _entries(_get(entry, "path"), k):
            if kind != "prepared":
                continue
            try:
                problem = _shards.check_prepared(path)
            except (ValueError, OSError) as e:
                raise ConfigError(k, first_line(e, type(e).__name__)) from None
            if problem:
                raise ConfigError(k, f"{problem}; not training on it (`mfsdp-data verify {path}` checks every byte)")

