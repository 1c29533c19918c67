"""Deterministic, stateless-by-position token batches.

Every training sample has a *global sample index* ``g``: a single counter over all data-parallel
(DP) ranks, micro-batches and optimizer steps. Sample ``g`` is a pure function of ``(seed, g)``
(plus the corpus, for ``data.name=text``), so there is no loader state to checkpoint:

* the loader is deterministic in (seed, step, DP rank);
* a resume continues exactly where it stopped, from ``consumed_samples = step * samples_per_step``;
* a resume at another DP size recomputes the starts from the same global counter.

Layout (``mbs`` = micro-batch size, ``ga`` = gradient-accumulation steps, ``dp`` = DP size)::

    start(step s, micro m, rank r) = (s * ga + m) * (mbs * dp) + r * mbs

so micro-batch ``m`` of rank ``r`` holds samples ``start .. start + mbs - 1``. The samples of
optimizer step ``s`` are exactly ``[s * S, (s + 1) * S)`` with ``S = samples_per_step =
mbs * ga * dp``, whatever the split into ranks and micro-batches: with the same global batch
size, ``dp=2, mbs=2`` concatenated over ranks equals ``dp=1, mbs=4``, and ``dp=1, mbs=2, ga=2``
covers the same samples per step. If the global batch size changes at a resume, pass
``base_step``/``base_samples`` (the step and ``consumed_samples`` of the checkpoint) to
:func:`microbatch_start` so the counter continues from the samples already consumed.

Datasets (``DataConfig.name``):

``synthetic``
    Sample ``g`` is ``seq_len + 1`` tokens drawn uniformly from ``[0, vocab_size)`` by
    ``numpy.random.default_rng([seed, g])``.

``text``
    A local corpus. ``data.path`` is a file, a directory (searched recursively for ``*.txt``,
    ``*.md``, ``*.py``, ``*.rst``; hidden directories and ``__pycache__`` skipped) or a glob
    (``**`` allowed; matched directories are searched like a directory). Null uses the Python
    standard library's ``.py`` sources under ``sysconfig.get_paths()["stdlib"]``, skipping
    the directories in :data:`STDLIB_SKIP_DIRS` (``site-packages``, ``test``/``tests``,
    ``idlelib``, ``turtledemo``, the ``encodings`` mapping tables, ...) and the
    machine-specific ``_sysconfigdata_*`` files. Files are sorted by path, joined with
    ``"\\n\\n"`` and the byte stream is cut at ``data.max_bytes``.

    Tokenizer: bytes by default (vocab 256, tokens are the raw UTF-8 bytes). If
    ``data.tokenizer`` is a ``tokenizer.json`` (or a directory holding one) it is loaded with
    the ``tokenizers`` library (a RuntimeError says so if that is not installed).

    Tokens are cached as a flat numpy memmap (uint8 for vocab <= 256, uint16 for <= 65535,
    else uint32) in the cache directory: ``data.cache_dir``, else ``$MFSDP_CACHE_DIR``, else
    ``~/.cache/mfsdp_launch/tokens``. The file name is a hash of the (sorted) source files with
    their sizes and mtimes, ``max_bytes`` and the tokenizer's identity (its content hash), so
    editing a source or the tokenizer rebuilds it. Several ranks may build at once: each writes
    a unique temporary file and ``os.replace``-s it into place (atomic; the content is the
    same, so it is idempotent), then a JSON sidecar (token count, dtype, sources) the same way;
    the sidecar is written last and marks the cache complete.

    Sample ``g`` is the window of ``seq_len + 1`` tokens at an offset drawn by
    ``default_rng([seed, g])`` uniformly from ``[0, n_tokens - seq_len - 1]``.

In both cases ``input_ids = window[:-1]`` and ``labels = window[1:]`` (next-token labels).

:func:`check_data_config` validates a config cheaply (no tokenization, no torch import) and is
what the launcher calls before spawning workers.
"""

from __future__ import annotations

import glob as _glob
import hashlib
import json
import logging
import os
import sysconfig
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .atomic_io import atomic_write

log = logging.getLogger(__name__)

TEXT_EXTENSIONS = (".txt", ".md", ".py", ".rst")
# Directory names never descended into when the corpus is the standard library.
STDLIB_SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "turtledemo",
        "encodings",  # generated codec mapping tables, not representative code
        "__pycache__",
        "lib-dynload",
    }
)
SEPARATOR = b"\n\n"
BYTE_VOCAB = 256
CACHE_FORMAT_VERSION = 1
DEFAULT_CACHE_DIR = os.path.join("~", ".cache", "mfsdp_launch", "tokens")
CACHE_DIR_ENV = "MFSDP_CACHE_DIR"
_GLOB_CHARS = set("*?[")


def _config_error(message: str) -> ValueError:
    """A ValueError (the project's ConfigError when available) for a one-line "key: problem"."""
    key, _, problem = message.partition(": ")
    try:
        from .errors import ConfigError
    except ImportError:  # pragma: no cover - errors.py is optional for this module
        return ValueError(message)
    try:
        err = ConfigError(key, problem)
    except TypeError:  # pragma: no cover - a different ConfigError signature
        return ValueError(message)
    return err if str(err) == message else ValueError(message)


# --------------------------------------------------------------------------------------------
# Sample layout
# --------------------------------------------------------------------------------------------


def samples_per_step(micro_batch_size: int, grad_accum_steps: int, dp_size: int) -> int:
    """Global samples consumed by one optimizer step: ``mbs * grad_accum * dp_size``."""
    for name, v in (
        ("micro_batch_size", micro_batch_size),
        ("grad_accum_steps", grad_accum_steps),
        ("dp_size", dp_size),
    ):
        if int(v) < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    return int(micro_batch_size) * int(grad_accum_steps) * int(dp_size)


def microbatch_start(
    step: int,
    micro: int,
    *,
    micro_batch_size: int,
    grad_accum_steps: int,
    dp_rank: int,
    dp_size: int,
    base_step: int = 0,
    base_samples: int = 0,
) -> int:
    """Global sample index of rank ``dp_rank``'s first sample in micro-batch ``micro`` of step ``step``.

    ``start = base_samples + ((step - base_step) * ga + micro) * (mbs * dp) + dp_rank * mbs``.
    With the defaults (``base_step = base_samples = 0``) this is the plain layout, and
    ``base_samples`` for step ``base_step`` is ``base_step * samples_per_step``. After a resume
    that changes the global batch size, pass the checkpoint's step and consumed samples.
    """
    samples_per_step(micro_batch_size, grad_accum_steps, dp_size)  # validates the sizes
    if not 0 <= micro < grad_accum_steps:
        raise ValueError(f"micro must be in [0, {grad_accum_steps}), got {micro}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    if step < base_step:
        raise ValueError(f"step {step} is before base_step {base_step}")
    per_micro = micro_batch_size * dp_size
    return (
        int(base_samples)
        + ((step - base_step) * grad_accum_steps + micro) * per_micro
        + dp_rank * micro_batch_size
    )


def _sample_rng(seed: int, g: int) -> np.random.Generator:
    # SeedSequence wants non-negative entropy; fold negative seeds into uint64.
    return np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, int(g)])


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding token ids < ``vocab_size``."""
    if vocab_size <= 256:
        return np.dtype(np.uint8)
    if vocab_size <= 65535:
        return np.dtype(np.uint16)
    return np.dtype(np.uint32)


# --------------------------------------------------------------------------------------------
# Corpus files
# --------------------------------------------------------------------------------------------


def _cfg(data_cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(data_cfg, dict):
        return data_cfg.get(key, default)
    return getattr(data_cfg, key, default)


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def _walk(root: str, exts: Sequence[str], skip_dirs: frozenset, skip_hidden: bool) -> List[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [
            d for d in dirnames if d not in skip_dirs and not (skip_hidden and d.startswith("."))
        ]
        for f in filenames:
            if f.endswith(tuple(exts)):
                out.append(os.path.join(dirpath, f))
    return out


def _stdlib_files() -> List[str]:
    root = stdlib_dir()
    files = _walk(root, (".py",), STDLIB_SKIP_DIRS, skip_hidden=True)
    files = [f for f in files if not os.path.basename(f).startswith("_sysconfigdata_")]
    return sorted(os.path.abspath(f) for f in files)


def resolve_text_files(data_cfg: Any) -> List[str]:
    """Sorted absolute paths of the text corpus's files (before ``max_bytes`` truncation).

    Raises ValueError naming ``data.path`` when nothing matches.
    """
    path = _cfg(data_cfg, "path")
    if path is None or str(path) == "":
        files = _stdlib_files()
        if not files:
            raise _config_error(
                f"data.path: null means the standard library's sources, but no .py files "
                f"were found under {stdlib_dir()!r}; set data.path"
            )
        return files
    path = os.path.expanduser(str(path))
    skip = frozenset({"__pycache__"})
    if os.path.isfile(path):
        return [os.path.abspath(path)]
    if os.path.isdir(path):
        files = _walk(path, TEXT_EXTENSIONS, skip, skip_hidden=True)
        if not files:
            exts = ", ".join("*" + e for e in TEXT_EXTENSIONS)
            raise _config_error(f"data.path: directory {path!r} has no {exts} files")
        return sorted({os.path.abspath(f) for f in files})
    if _GLOB_CHARS & set(path):
        found = set()
        for m in _glob.glob(path, recursive=True):
            if os.path.isdir(m):
                found.update(
                    os.path.abspath(f) for f in _walk(m, TEXT_EXTENSIONS, skip, skip_hidden=True)
                )
            elif os.path.isfile(m):
                found.add(os.path.abspath(m))
        if not found:
            raise _config_error(f"data.path: no files match {path!r}")
        return sorted(found)
    raise _config_error(f"data.path: {path!r} does not exist (expected a file, directory or glob)")


def _select_sources(files: Sequence[str], max_bytes: int) -> List[Tuple[str, int, int]]:
    """The prefix of ``files`` needed for ``max_bytes`` of joined text, as (path, size, mtime_ns)."""
    out = []
    total = 0
    for f in files:
        st = os.stat(f)
        if out:
            total += len(SEPARATOR)
        out.append((f, int(st.st_size), int(st.st_mtime_ns)))
        total += st.st_size
        if total >= max_bytes:
            break
    return out


def _describe_path(data_cfg: Any) -> str:
    path = _cfg(data_cfg, "path")
    return repr(str(path)) if path else f"null (standard library at {stdlib_dir()!r})"


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def _tokenizer_file(data_cfg: Any) -> Optional[str]:
    tok = _cfg(data_cfg, "tokenizer")
    if tok is None or str(tok) == "":
        return None
    p = os.path.expanduser(str(tok))
    if os.path.isdir(p):
        p = os.path.join(p, "tokenizer.json")
    if not os.path.isfile(p):
        raise _config_error(f"data.tokenizer: no tokenizer.json at {str(tok)!r}")
    return os.path.abspath(p)


def _json_vocab_size(path: str) -> int:
    """Vocab size of a HuggingFace ``tokenizer.json`` (max id + 1 over the model and added tokens)."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            spec = json.load(f)
    except (OSError, ValueError) as e:
        raise _config_error(f"data.tokenizer: cannot read {path!r} as JSON: {e}") from None
    model = spec.get("model") or {}
    vocab = model.get("vocab")
    n = 0
    if isinstance(vocab, dict):
        n = max((int(v) for v in vocab.values()), default=-1) + 1
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        n = len(vocab)
    for t in spec.get("added_tokens") or []:
        if isinstance(t, dict) and "id" in t:
            n = max(n, int(t["id"]) + 1)
    if n <= 0:
        raise _config_error(f"data.tokenizer: {path!r} has no model.vocab or added_tokens")
    return n


def tokenizer_vocab_size(data_cfg: Any) -> int:
    """Vocab the tokenizer needs: 256 for bytes, else read from ``tokenizer.json`` (no import)."""
    path = _tokenizer_file(data_cfg)
    return BYTE_VOCAB if path is None else _json_vocab_size(path)


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _load_hf_tokenizer(path: str):
    try:
        from tokenizers import Tokenizer  # type: ignore
    except ImportError:
        raise RuntimeError(
            f"data.tokenizer={path!r} needs the 'tokenizers' package, which is not installed "
            f"(pip install tokenizers), or set data.tokenizer=null for byte tokens"
        ) from None
    return Tokenizer.from_file(path)


# --------------------------------------------------------------------------------------------
# Validation (cheap, no torch)
# --------------------------------------------------------------------------------------------


def check_data_config(data_cfg: Any, *, vocab_size: Optional[int]) -> None:
    """Validate ``data_cfg`` without tokenizing or importing torch.

    Raises ValueError with a one-line message naming the offending key. ``vocab_size`` is the
    model's vocab; it must be >= the tokenizer's (256 for bytes). None skips that comparison.
    """
    from .config.schema import Dataset

    name = _cfg(data_cfg, "name", "synthetic")
    if name not in set(Dataset):
        raise _config_error(f"data.name: unknown dataset {name!r}; expected one of {', '.join(Dataset)}")
    if vocab_size is not None and int(vocab_size) < 1:
        raise _config_error(f"model.vocab_size: must be >= 1, got {vocab_size}")
    if name == "synthetic":
        return  # tokens are drawn from [0, vocab_size); path/tokenizer are unused
    max_bytes = _cfg(data_cfg, "max_bytes", 0)
    if max_bytes is None or int(max_bytes) < 1:
        raise _config_error(f"data.max_bytes: must be >= 1, got {max_bytes}")
    files = resolve_text_files(data_cfg)
    if all(os.path.getsize(f) == 0 for f in files):
        raise _config_error(f"data.path: all {len(files)} file(s) of {_describe_path(data_cfg)} are empty")
    tok_vocab = tokenizer_vocab_size(data_cfg)
    if vocab_size is not None and int(vocab_size) < tok_vocab:
        tok = _cfg(data_cfg, "tokenizer")
        what = "the byte tokenizer (data.tokenizer=null)" if not tok else f"data.tokenizer {str(tok)!r}"
        raise _config_error(
            f"model.vocab_size: {vocab_size} is smaller than the vocab {tok_vocab} of {what}"
        )
    cache_dir = _cfg(data_cfg, "cache_dir")
    if cache_dir:
        p = os.path.expanduser(str(cache_dir))
        if os.path.exists(p) and not os.path.isdir(p):
            raise _config_error(f"data.cache_dir: {str(cache_dir)!r} exists and is not a directory")


# --------------------------------------------------------------------------------------------
# Token cache
# --------------------------------------------------------------------------------------------


def cache_dir_for(data_cfg: Any) -> str:
    """``data.cache_dir``, else ``$MFSDP_CACHE_DIR``, else ``~/.cache/mfsdp_launch/tokens``."""
    d = _cfg(data_cfg, "cache_dir") or os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR
    return os.path.abspath(os.path.expanduser(str(d)))


def _read_sidecar(meta_path: str, bin_path: str, dtype: np.dtype) -> Optional[Dict[str, Any]]:
    """The sidecar if it and the token file form a complete cache, else None."""
    try:
        with open(meta_path, "r", encoding="utf-8") as f:
            meta = json.load(f)
        n = int(meta["n_tokens"])
        ok = (
            meta.get("version") == CACHE_FORMAT_VERSION
            and np.dtype(meta["dtype"]) == dtype
            and os.path.getsize(bin_path) == n * dtype.itemsize
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta if ok else None


def _read_chunks(sources: Sequence[Tuple[str, int, int]], max_bytes: int) -> List[bytes]:
    """File contents joined by SEPARATOR and cut at ``max_bytes`` bytes, as a list of pieces."""
    pieces: List[bytes] = []
    left = max_bytes
    for i, (path, _, _) in enumerate(sources):
        if left <= 0:
            break
        if i:
            sep = SEPARATOR[:left]
            pieces.append(sep)
            left -= len(sep)
            if left <= 0:
                break
        with open(path, "rb") as f:
            data = f.read(left)
        pieces.append(data)
        left -= len(data)
    return pieces


def build_token_cache(data_cfg: Any) -> Tuple[str, Dict[str, Any]]:
    """Build (or reuse) the token cache for a text config; returns (token file path, sidecar)."""
    max_bytes = int(_cfg(data_cfg, "max_bytes", 0) or 0)
    if max_bytes < 1:
        raise _config_error(f"data.max_bytes: must be >= 1, got {max_bytes}")
    files = resolve_text_files(data_cfg)
    sources = _select_sources(files, max_bytes)
    tok_path = _tokenizer_file(data_cfg)
    if tok_path is None:
        tok_id: Dict[str, Any] = {"kind": "bytes"}
        vocab = BYTE_VOCAB
    else:
        tok_id = {"kind": "tokenizer.json", "sha256": _file_sha256(tok_path)}
        vocab = _json_vocab_size(tok_path)
    dtype = token_dtype(vocab)

    key = json.dumps(
        {
            "version": CACHE_FORMAT_VERSION,
            "sources": sources,
            "max_bytes": max_bytes,
            "separator": SEPARATOR.decode(),
            "tokenizer": tok_id,
            "dtype": dtype.name,
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    cdir = cache_dir_for(data_cfg)
    os.makedirs(cdir, exist_ok=True)
    bin_path = os.path.join(cdir, f"{digest}.bin")
    meta_path = os.path.join(cdir, f"{digest}.json")

    meta = _read_sidecar(meta_path, bin_path, dtype)
    if meta is not None:
        return bin_path, meta

    pieces = _read_chunks(sources, max_bytes)
    n_bytes = sum(len(p) for p in pieces)
    if tok_path is None:

        def write_tokens(f):
            for p in pieces:
                f.write(p)

        n_tokens = n_bytes
    else:
        tok = _load_hf_tokenizer(tok_path)
        vocab = max(vocab, int(tok.get_vocab_size(with_added_tokens=True)))
        dtype = token_dtype(vocab)
        sep_ids = tok.encode(SEPARATOR.decode(), add_special_tokens=False).ids
        # pieces alternate text, separator, text, ...; encode the texts only.
        texts = [p.decode("utf-8", errors="replace") for p in pieces[0::2]]
        enc = tok.encode_batch(texts, add_special_tokens=False) if texts else []
        parts: List[np.ndarray] = []
        for i, e in enumerate(enc):
            if i:
                parts.append(np.asarray(sep_ids, dtype=np.int64))
            parts.append(np.asarray(e.ids, dtype=np.int64))
        ids = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        arr = ids.astype(dtype)

        def write_tokens(f):
            arr.tofile(f)

        n_tokens = int(arr.size)

    atomic_write(bin_path, write_tokens)
    meta = {
        "version": CACHE_FORMAT_VERSION,
        "n_tokens": int(n_tokens),
        "n_bytes": int(n_bytes),
        "dtype": dtype.name,
        "vocab_size": int(vocab),
        "max_bytes": max_bytes,
        "tokenizer": tok_path or "bytes",
        "tokenizer_id": tok_id,
        "separator": SEPARATOR.decode(),
        "sources": [s[0] for s in sources],
    }
    payload = json.dumps(meta, indent=1).encode()
    atomic_write(meta_path, lambda f: f.write(payload))
    log.info("built token cache %s: %d tokens from %d files", bin_path, n_tokens, len(sources))
    return bin_path, meta


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------


class TokenBatches:
    """Micro-batches of ``{"input_ids", "labels"}`` (LongTensor ``[mbs, seq_len]``, CPU).

    ``batch(g)`` returns global samples ``g .. g + mbs - 1``; use :func:`microbatch_start` (or
    :meth:`microbatch`) for ``g``. ``vocab_size`` is the tokenizer's vocab (256 for bytes; the
    model's vocab for synthetic data).
    """

    def __init__(
        self,
        data_cfg: Any,
        *,
        seq_len: int,
        micro_batch_size: int,
        vocab_size: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
    ):
        if seq_len < 1:
            raise _config_error(f"train.seq_len: must be >= 1, got {seq_len}")
        if micro_batch_size < 1:
            raise _config_error(f"train.micro_batch_size: must be >= 1, got {micro_batch_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        check_data_config(data_cfg, vocab_size=vocab_size)
        self.name = _cfg(data_cfg, "name", "synthetic")
        self.seq_len = int(seq_len)
        self.micro_batch_size = int(micro_batch_size)
        self.model_vocab_size = int(vocab_size)
        self.seed = int(seed)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.path: Optional[str] = None
        self.meta: Optional[Dict[str, Any]] = None
        self.n_tokens = 0
        self._tokens: Optional[np.ndarray] = None
        if self.name == "synthetic":
            self.vocab_size = int(vocab_size)
            return
        self.path, self.meta = build_token_cache(data_cfg)
        self.vocab_size = int(self.meta["vocab_size"])
        if self.vocab_size > self.model_vocab_size:
            raise _config_error(
                f"model.vocab_size: {vocab_size} is smaller than the tokenizer's vocab {self.vocab_size}"
            )
        self.n_tokens = int(self.meta["n_tokens"])
        if self.n_tokens < self.seq_len + 1:
            raise _config_error(
                f"data.path: corpus {_describe_path(data_cfg)} has {self.n_tokens} tokens "
                f"(data.max_bytes={_cfg(data_cfg, 'max_bytes')}), fewer than "
                f"train.seq_len + 1 = {self.seq_len + 1}"
            )

    # memmaps do not pickle as maps; reopen lazily (e.g. in DataLoader workers).
    def __getstate__(self):
        state = dict(self.__dict__)
        state["_tokens"] = None
        return state

    @property
    def tokens(self) -> np.ndarray:
        if self._tokens is None:
            assert self.path is not None and self.meta is not None
            self._tokens = np.memmap(
                self.path, dtype=np.dtype(self.meta["dtype"]), mode="r", shape=(self.n_tokens,)
            )
        return self._tokens

    def sample(self, g: int) -> np.ndarray:
        """Global sample ``g`` as ``seq_len + 1`` int64 tokens (inputs are [:-1], labels [1:])."""
        if g < 0:
            raise ValueError(f"sample index must be >= 0, got {g}")
        rng = _sample_rng(self.seed, g)
        n = self.seq_len + 1
        if self.name == "synthetic":
            return rng.integers(0, self.vocab_size, size=n, dtype=np.int64)
        off = int(rng.integers(0, self.n_tokens - n, endpoint=True))
        return np.asarray(self.tokens[off : off + n], dtype=np.int64)

    def batch_numpy(self, global_sample_start: int) -> np.ndarray:
        out = np.empty((self.micro_batch_size, self.seq_len + 1), dtype=np.int64)
        for i in range(self.micro_batch_size):
            out[i] = self.sample(int(global_sample_start) + i)
        return out

    def batch(self, global_sample_start: int) -> Dict[str, Any]:
        import torch

        w = torch.from_numpy(self.batch_numpy(global_sample_start))
        return {"input_ids": w[:, :-1].contiguous(), "labels": w[:, 1:].contiguous()}

    def microbatch(self, step: int, micro: int, *, grad_accum_steps: int, **base) -> Dict[str, Any]:
        """This rank's batch for optimizer step ``step``, micro-batch ``micro``."""
        return self.batch(
            microbatch_start(
                step,
                micro,
                micro_batch_size=self.micro_batch_size,
                grad_accum_steps=grad_accum_steps,
                dp_rank=self.dp_rank,
                dp_size=self.dp_size,
                **base,
            )
        )


__all__ = [
    "TokenBatches",
    "samples_per_step",
    "microbatch_start",
    "check_data_config",
    "resolve_text_files",
    "tokenizer_vocab_size",
    "build_token_cache",
    "cache_dir_for",
    "token_dtype",
]
