"""``data=text``: local text files (the Python standard library's sources by default), tokenized
once at start-up into a cached corpus directory of the same shard format ``mfsdp-data prepare``
writes, so the one reader of ``data=tokens`` serves it (docs/data.md).

``data.path`` is a file, a directory (searched recursively for ``*.txt``, ``*.md``, ``*.py``,
``*.rst``; hidden directories and ``__pycache__`` skipped) or a glob (``**`` allowed; matched
directories are searched like a directory). Null uses the standard library's ``.py`` sources,
skipping :data:`STDLIB_SKIP_DIRS` and the machine-specific ``_sysconfigdata_*`` files. Files are
sorted by path, joined with ``"\\n\\n"``, and the byte stream is cut at ``data.max_bytes``.

Tokenizer: bytes by default (vocab 256). ``data.tokenizer`` names a ``tokenizer.json`` (or a
directory holding one), run with the ``tokenizers`` library; each file is encoded on its own and
the separator's ids go between them.

The cache is ``CACHE_DIR/<key>/`` (``data.cache_dir``, else ``$MFSDP_CACHE_DIR``, else
``~/.cache/mfsdp_launch/tokens``): one Megatron shard whose documents are the files (each with
the separator after it) and a ``manifest.json``. The key hashes the files with their sizes and
mtimes, ``max_bytes`` and the tokenizer's content, so editing any of them rebuilds it. Ranks may
build at once: every file is written to a unique temporary name and renamed into place (same
content, so idempotent), and the manifest, written last, marks the cache complete. A cache is
verified against its manifest's checksums whenever it is opened (the launcher opens it once
before spawning): a damaged one is rebuilt, with a warning naming the file, never trained on.
"""

from __future__ import annotations

import glob as _glob
import hashlib
import json
import logging
import os
import sys
import sysconfig
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

if TYPE_CHECKING:  # numpy is imported where tokens are made: the launcher's checks stay without it
    import numpy as np

from ..core.errors import ConfigError

log = logging.getLogger(__name__)

TEXT_EXTENSIONS = (".txt", ".md", ".py", ".rst")
# Directory names never descended into when the corpus is the standard library.
STDLIB_SKIP_DIRS = frozenset({
    "site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "turtledemo",
    "encodings",  # generated codec mapping tables, not representative code
    "__pycache__", "lib-dynload",
})
SEPARATOR = b"\n\n"
BYTE_VOCAB = 256
CACHE_FORMAT_VERSION = 2  # 2: a prepared-format directory (1 was a flat .bin + .json sidecar)
_GLOB_CHARS = set("*?[")


def cfg_get(data_cfg: Any, key: str, default: Any = None) -> Any:
    """A data config value from a dict, a dataclass or an OmegaConf node."""
    if isinstance(data_cfg, dict):
        return data_cfg.get(key, default)
    return getattr(data_cfg, key, default)


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest Megatron token dtype for ids < ``vocab_size`` (uint8, uint16, else int32)."""
    import numpy as np

    if vocab_size <= 256:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    return np.dtype(np.int32)


def cache_dir_for(data_cfg: Any) -> str:
    """``data.cache_dir``, else ``$MFSDP_CACHE_DIR``, else ``~/.cache/mfsdp_launch/tokens``."""
    from ..corpus.cache import cache_dir

    return cache_dir(cfg_get(data_cfg, "cache_dir"))


# ------------------------------------------------------------------------------------ files


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def _walk(root: str, exts: Sequence[str], skip_dirs: frozenset, skip_hidden: bool) -> List[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip_dirs and not (skip_hidden and d.startswith("."))]
        out += [os.path.join(dirpath, f) for f in filenames if f.endswith(tuple(exts))]
    return out


def _stdlib_files() -> List[str]:
    files = _walk(stdlib_dir(), (".py",), STDLIB_SKIP_DIRS, skip_hidden=True)
    return sorted(os.path.abspath(f) for f in files if not os.path.basename(f).startswith("_sysconfigdata_"))


def resolve_text_files(data_cfg: Any) -> List[str]:
    """Sorted absolute paths of the text corpus's files (before ``max_bytes``); ConfigError if none."""
    path = cfg_get(data_cfg, "path")
    if path is None or str(path) == "":
        files = _stdlib_files()
        if not files:
            raise ConfigError("data.path", f"null means the standard library's sources, but no .py files were "
                              f"found under {stdlib_dir()!r}; set data.path")
        return files
    path = os.path.expanduser(str(path))
    skip = frozenset({"__pycache__"})
    if os.path.isfile(path):
        return [os.path.abspath(path)]
    if os.path.isdir(path):
        files = _walk(path, TEXT_EXTENSIONS, skip, skip_hidden=True)
        if not files:
            exts = ", ".join("*" + e for e in TEXT_EXTENSIONS)
            raise ConfigError("data.path", f"directory {path!r} has no {exts} files")
        return sorted({os.path.abspath(f) for f in files})
    if _GLOB_CHARS & set(path):
        found = set()
        for m in _glob.glob(path, recursive=True):
            if os.path.isdir(m):
                found.update(os.path.abspath(f) for f in _walk(m, TEXT_EXTENSIONS, skip, skip_hidden=True))
            elif os.path.isfile(m):
                found.add(os.path.abspath(m))
        if not found:
            raise ConfigError("data.path", f"no files match {path!r}")
        return sorted(found)
    raise ConfigError("data.path", f"{path!r} does not exist (expected a file, directory or glob)")


def select_sources(files: Sequence[str], max_bytes: int) -> List[Tuple[str, int, int]]:
    """The prefix of ``files`` needed for ``max_bytes`` of joined text, as (path, size, mtime_ns)."""
    out, total = [], 0
    for f in files:
        st = os.stat(f)
        if out:
            total += len(SEPARATOR)
        out.append((f, int(st.st_size), int(st.st_mtime_ns)))
        total += st.st_size
        if total >= max_bytes:
            break
    return out


def describe_path(data_cfg: Any) -> str:
    path = cfg_get(data_cfg, "path")
    return repr(str(path)) if path else f"null (standard library at {stdlib_dir()!r})"


# ------------------------------------------------------------------------------------ tokenizer


def tokenizer_file(data_cfg: Any) -> Optional[str]:
    tok = cfg_get(data_cfg, "tokenizer")
    if tok is None or str(tok) == "":
        return None
    p = os.path.expanduser(str(tok))
    if os.path.isdir(p):
        p = os.path.join(p, "tokenizer.json")
    if not os.path.isfile(p):
        raise ConfigError("data.tokenizer", f"no tokenizer.json at {str(tok)!r}")
    return os.path.abspath(p)


def json_vocab_size(path: str) -> int:
    """Vocab size of a HuggingFace ``tokenizer.json`` (max id + 1 over the model and added tokens)."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            spec = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError("data.tokenizer", f"cannot read {path!r} as JSON: {e}") from None
    vocab = (spec.get("model") or {}).get("vocab")
    n = 0
    if isinstance(vocab, dict):
        n = max((int(v) for v in vocab.values()), default=-1) + 1
    elif isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        n = len(vocab)
    for t in spec.get("added_tokens") or []:
        if isinstance(t, dict) and "id" in t:
            n = max(n, int(t["id"]) + 1)
    if n <= 0:
        raise ConfigError("data.tokenizer", f"{path!r} has no model.vocab or added_tokens")
    return n


def tokenizer_vocab_size(data_cfg: Any) -> int:
    """Vocab the tokenizer needs: 256 for bytes, else read from ``tokenizer.json`` (no import)."""
    path = tokenizer_file(data_cfg)
    return BYTE_VOCAB if path is None else json_vocab_size(path)


def _load_hf_tokenizer(path: str):
    try:
        from tokenizers import Tokenizer  # type: ignore
    except ImportError:
        raise RuntimeError(f"data.tokenizer={path!r} needs the 'tokenizers' package, which is not installed "
                           f"(pip install tokenizers), or set data.tokenizer=null for byte tokens") from None
    return Tokenizer.from_file(path)


# ------------------------------------------------------------------------------------ cache


def _read_pieces(sources: Sequence[Tuple[str, int, int]], max_bytes: int) -> List[bytes]:
    """Each file's bytes with the separator after it (all but the last), cut at ``max_bytes`` in all."""
    pieces: List[bytes] = []
    left = max_bytes
    for i, (path, _, _) in enumerate(sources):
        if left <= 0:
            break
        with open(path, "rb") as f:
            data = f.read(left)
        left -= len(data)
        sep = SEPARATOR[:left] if i + 1 < len(sources) else b""
        left -= len(sep)
        pieces.append(data + sep)
    return pieces


def _tokenize(pieces: List[bytes], tok_path: Optional[str], vocab: int):
    """(tokens, document lengths, vocab): one document per file (its separator included)."""
    import numpy as np

    if tok_path is None:
        docs = [np.frombuffer(p, dtype=np.uint8) for p in pieces]
    else:
        tok = _load_hf_tokenizer(tok_path)
        vocab = max(vocab, int(tok.get_vocab_size(with_added_tokens=True)))
        sep_ids = tok.encode(SEPARATOR.decode(), add_special_tokens=False).ids
        texts, seps = [], []
        for p in pieces:
            has_sep = p.endswith(SEPARATOR)
            texts.append((p[: -len(SEPARATOR)] if has_sep else p).decode("utf-8", errors="replace"))
            seps.append(sep_ids if has_sep else [])
        enc = tok.encode_batch(texts, add_special_tokens=False) if texts else []
        docs = [np.asarray(e.ids + s, dtype=np.int64) for e, s in zip(enc, seps)]
    docs = [d for d in docs if len(d)]
    dtype = token_dtype(vocab)
    tokens = np.concatenate(docs).astype(dtype) if docs else np.zeros(0, dtype)
    return tokens, [len(d) for d in docs], vocab


def _cache_key(sources, max_bytes: int, tok_id: Dict[str, Any], vocab: int) -> str:
    key = json.dumps({"version": CACHE_FORMAT_VERSION, "sources": sources, "max_bytes": max_bytes,
                      "separator": SEPARATOR.decode(), "tokenizer": tok_id, "dtype": token_dtype(vocab).name},
                     sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def build_token_cache(data_cfg: Any) -> Tuple[str, Dict[str, Any]]:
    """Build (or reuse) the cached corpus directory of a text config; returns (directory, manifest)."""
    from ..corpus import shards
    from ..corpus.tokenizer import file_sha256

    max_bytes = int(cfg_get(data_cfg, "max_bytes", 0) or 0)
    if max_bytes < 1:
        raise ConfigError("data.max_bytes", f"must be >= 1, got {max_bytes}")
    sources = select_sources(resolve_text_files(data_cfg), max_bytes)
    tok_path = tokenizer_file(data_cfg)
    if tok_path is None:
        tok_id: Dict[str, Any] = {"kind": "bytes"}
        vocab = BYTE_VOCAB
    else:
        tok_id = {"kind": "tokenizer.json", "sha256": file_sha256(tok_path)}
        vocab = json_vocab_size(tok_path)
    out = os.path.join(cache_dir_for(data_cfg), _cache_key(sources, max_bytes, tok_id, vocab))
    damage = ""
    try:
        manifest = shards.open_prepared(out)[0]
        # Every byte checked (a cache is at most max_bytes of tokens): a damaged one is rebuilt.
        problems = shards.verify(out)
        if not problems:
            return out, manifest
        damage = problems[0]
    except ValueError:  # absent, or torn by someone: (re)build it
        pass
    tokens, lengths, vocab = _tokenize(_read_pieces(sources, max_bytes), tok_path, vocab)
    os.makedirs(out, exist_ok=True)
    entry = shards.write_shard(out, 0, tokens, lengths)
    meta = {"tokenizer": {"file": tok_path or "bytes", "sha256": tok_id.get("sha256", "bytes"),
                          "vocab_size": int(vocab)},
            "eos_id": None, "dtype": tokens.dtype.name, "kind": "text-cache", "max_bytes": max_bytes,
            "separator": SEPARATOR.decode(), "inputs": [s[0] for s in sources]}
    manifest = shards.build_manifest([entry] if len(tokens) else [], meta)
    shards.write_manifest(out, manifest)
    log.info("built token cache %s: %d tokens from %d files", out, len(tokens), len(sources))
    if damage:
        print(f"mfsdp-train: warning: data=text: the token cache {out} was damaged ({damage}); rebuilt it from "
              f"the text files", file=sys.stderr, flush=True)
    return out, manifest
