"""The data rules the launcher runs before spawning anything: cheap (manifests and headers only,
no tokenization), torch-free, one ``ConfigError`` line per problem, naming the key."""

from __future__ import annotations

import os
from typing import Any, Optional

from ..core.errors import ConfigError
from .text import cfg_get, describe_path, resolve_text_files, tokenizer_vocab_size

# Keys that only some datasets read: setting one elsewhere would do nothing, so it is refused.
_ONLY_FOR = {
    "sources": ("tokens",), "val_sources": ("tokens",), "eos_id": ("tokens",),
    "pack": ("text", "tokens"), "doc_mask": ("text", "tokens"), "val_fraction": ("text", "tokens"),
    "path": ("text",), "tokenizer": ("text",),
}
_DEFAULTS = {"sources": [], "val_sources": [], "eos_id": None, "pack": "windows", "doc_mask": False,
             "val_fraction": 0.0, "path": None, "tokenizer": None}


def has_validation(data_cfg: Any) -> bool:
    """Whether the data holds out a validation split (``val_fraction`` > 0 or ``val_sources``)."""
    name = str(cfg_get(data_cfg, "name", "synthetic"))
    return name != "synthetic" and (float(cfg_get(data_cfg, "val_fraction", 0.0) or 0.0) > 0
                                    or bool(cfg_get(data_cfg, "val_sources") or []))


def check_data_config(data_cfg: Any, *, vocab_size: Optional[int], train: Any = None) -> None:
    """Validate ``data_cfg`` without tokenizing or importing torch; ConfigError on the first problem.

    ``vocab_size`` is the model's vocab: it must hold the tokenizer's (256 for bytes); None skips
    that. ``train`` (the ``train`` section) adds the checks that need ``seq_len`` and the
    validation settings.
    """
    from ..core.schema import Dataset

    name = cfg_get(data_cfg, "name", "synthetic")
    if name not in set(Dataset):
        raise ConfigError("data.name", f"unknown dataset {name!r}", list(Dataset))
    name = str(name)
    if vocab_size is not None and int(vocab_size) < 1:
        raise ConfigError("model.vocab_size", f"must be >= 1, got {vocab_size}")
    _check_keys_apply(data_cfg, name)
    _check_validation(data_cfg, name, train)
    seq_len = None if train is None else int(train.seq_len)
    if name == "text":
        _check_text(data_cfg, vocab_size)
    elif name == "tokens":
        _check_tokens(data_cfg, vocab_size, seq_len)


def loss_masked_source(data_cfg: Any) -> Optional[str]:
    """The key of the first ``data.sources`` / ``data.val_sources`` entry with a loss mask (chat data
    from ``mfsdp-data prepare --chat``), or None; reads manifests only."""
    if str(cfg_get(data_cfg, "name", "synthetic")) != "tokens":
        return None
    from ..corpus import resolve
    from ..corpus.sources import entry_path

    for key in ("sources", "val_sources"):
        for i, entry in enumerate(cfg_get(data_cfg, key) or []):
            if resolve(entry_path(entry), key=f"data.{key}[{i}].path").has_mask:
                return f"data.{key}[{i}]"
    return None


def check_data_integrity(data_cfg: Any) -> None:
    """The launcher's check of the data's bytes before spawning: every prepared shard of
    ``data.sources`` / ``data.val_sources`` against its manifest's sizes and sampled checksums
    (a few KiB per file); ConfigError naming the damaged file. (``data=text``: its token cache is
    verified in full wherever it is opened, and rebuilt when damaged: text.py.)"""
    if str(cfg_get(data_cfg, "name", "synthetic")) != "tokens":
        return
    from ..corpus import check_integrity

    check_integrity(list(cfg_get(data_cfg, "sources") or []), key="data.sources")
    check_integrity(list(cfg_get(data_cfg, "val_sources") or []), key="data.val_sources")


def _check_keys_apply(data_cfg: Any, name: str) -> None:
    for key, names in _ONLY_FOR.items():
        value = cfg_get(data_cfg, key, _DEFAULTS[key])
        if name not in names and _is_set(value, _DEFAULTS[key]):
            raise ConfigError(f"data.{key}", f"does nothing with data={name}",
                              f"unset, or data={'|'.join(names)}")


def _is_set(value: Any, default: Any) -> bool:
    if isinstance(default, list):
        return len(value or []) > 0
    return value is not None and value != default and str(value) != str(default)


def _check_validation(data_cfg: Any, name: str, train: Any) -> None:
    f = float(cfg_get(data_cfg, "val_fraction", 0.0) or 0.0)
    if not 0.0 <= f < 1.0:
        raise ConfigError("data.val_fraction", f"{f} is outside [0, 1)")
    if f > 0 and cfg_get(data_cfg, "val_sources"):
        raise ConfigError("data.val_fraction", f"{f} and data.val_sources both name validation data",
                          "0 with data.val_sources, or data.val_sources=[]")
    if train is None:
        return
    if int(train.val_steps) < 1:
        raise ConfigError("train.val_steps", f"must be >= 1, got {train.val_steps}")
    if int(train.val_interval) < 0:
        raise ConfigError("train.val_interval", f"must be >= 0, got {train.val_interval}",
                          "0 (validate at the end only) or a step count")
    if int(train.val_interval) > 0 and not has_validation(data_cfg):
        need = "data.val_fraction or data.val_sources" if name == "tokens" else "data.val_fraction"
        if name == "synthetic":
            need = "data=text|tokens with data.val_fraction"
        raise ConfigError("train.val_interval", f"{train.val_interval} needs held-out data: data={name} has none",
                          f"0, or set {need}")


def _check_text(data_cfg: Any, vocab_size: Optional[int]) -> None:
    max_bytes = cfg_get(data_cfg, "max_bytes", 0)
    if max_bytes is None or int(max_bytes) < 1:
        raise ConfigError("data.max_bytes", f"must be >= 1, got {max_bytes}")
    files = resolve_text_files(data_cfg)
    if all(os.path.getsize(f) == 0 for f in files):
        raise ConfigError("data.path", f"all {len(files)} file(s) of {describe_path(data_cfg)} are empty")
    if str(cfg_get(data_cfg, "pack", "windows")) == "documents" and len(files) < 2:
        raise ConfigError("data.pack", f"documents starts samples at files, but {describe_path(data_cfg)} is one file",
                          "windows, or a data.path of several files")
    tok_vocab = tokenizer_vocab_size(data_cfg)
    if vocab_size is not None and int(vocab_size) < tok_vocab:
        tok = cfg_get(data_cfg, "tokenizer")
        what = "the byte tokenizer (data.tokenizer=null)" if not tok else f"data.tokenizer {str(tok)!r}"
        raise ConfigError("model.vocab_size", f"{vocab_size} is smaller than the vocab {tok_vocab} of {what}")
    cache_dir = cfg_get(data_cfg, "cache_dir")
    if cache_dir:
        p = os.path.expanduser(str(cache_dir))
        if os.path.exists(p) and not os.path.isdir(p):
            raise ConfigError("data.cache_dir", f"{str(cache_dir)!r} exists and is not a directory")


def _check_tokens(data_cfg: Any, vocab_size: Optional[int], seq_len: Optional[int]) -> None:
    from ..corpus import check_sources

    pack, eos_id = str(cfg_get(data_cfg, "pack", "windows")), cfg_get(data_cfg, "eos_id")
    if eos_id is not None and not 0 <= int(eos_id) < (vocab_size or 1 << 62):
        raise ConfigError("data.eos_id", f"{eos_id} is not a token id of the model's vocab [0, {vocab_size})")
    f = float(cfg_get(data_cfg, "val_fraction", 0.0) or 0.0)
    kw = dict(seq_len=seq_len, model_vocab=vocab_size, pack=pack, eos_id=eos_id)
    train = check_sources(list(cfg_get(data_cfg, "sources") or []), key="data.sources", val_fraction=f, **kw)
    val_sources = list(cfg_get(data_cfg, "val_sources") or [])
    if not val_sources:
        return
    val = check_sources(val_sources, key="data.val_sources", **kw)
    a, b = train[0].tokenizer_sha256, val[0].tokenizer_sha256
    if None not in (a, b) and a != b:
        raise ConfigError("data.val_sources[0].path", f"{val[0].spec!r} was tokenized with another tokenizer "
                          f"than data.sources[0] ({train[0].spec!r})")
