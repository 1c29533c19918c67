"""``mfsdp-data``: prepare a token corpus, verify it, describe any readable corpus.

::

    mfsdp-data prepare INPUT... --tokenizer TOKENIZER_JSON --out DIR [--field text]
                       [--workers N] [--eos-id ID | --eos-token TOKEN] [--shard-mb MB]
                       [--chat [--train-on assistant|last|all] [--chat-template FILE]]
    mfsdp-data verify DIR          # size and checksum of every shard against the manifest
    mfsdp-data info PATH...        # format, tokens, documents, vocab of any readable source

``--chat`` reads conversations (JSON lines; corpus/chat.py), renders each with the tokenizer
directory's chat template and writes a loss mask beside the tokens (``shard_*.mask``: which
tokens the loss trains on). Rows that cannot be trained on are counted by kind and reported.

``prepare`` is resumable: each finished shard is appended to ``DIR/progress.jsonl``; a rerun of
the same command (same inputs, tokenizer and options) skips those and continues. The output
is byte-identical for the same inputs whatever the worker count. Bad input is one line, exit 2
(an unreadable input or a dangling link before any work; an input refused for holding no
document leaves no ``DIR`` behind); an interruption exits 130 and says how to continue. A prepare
holds a lock on ``DIR`` (flock on the directory): a second one into it waits, then finds it done.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import multiprocessing as mp
import os
import queue as _queue
import sys
import time
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from ..core.errors import ConfigError
from . import inputs, shard_writer, shards, tokenizer as tk
from .progress import Progress
from ..core.names import first_line

PROGRESS = "progress.jsonl"
STOP_AFTER_ENV = "MFSDP_DATA_STOP_AFTER"  # tests: behave as if Ctrl-C came after N shards


def shard_dtype(vocab: int) -> np.dtype:
    """uint16 when every id fits, else int32 (Megatron's 4-byte code; no vocab nears 2**31)."""
    return np.dtype(np.uint16) if vocab <= 1 << 16 else np.dtype(np.int32)


def auto_shard_bytes(files: Sequence[str]) -> int:
    """Input bytes per shard when not given: total / 256, within 1..64 MB.

    Shards are the unit of parallel work, so a small corpus still feeds many workers, while a
    large one is not cut into a sea of files. It depends on the inputs only, not on --workers.
    """
    total = sum(os.path.getsize(f) for f in files)
    return int(min(max(total // 256, 1_000_000), 64_000_000))


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        return os.cpu_count() or 1


def _fingerprint(files: Sequence[str], settings: Dict[str, Any]) -> str:
    stats = [(f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]
    blob = json.dumps({"inputs": stats, **settings}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()


class _Ledger:
    """``DIR/progress.jsonl``: the plan's fingerprint, then one line per finished shard (fsynced)."""

    def __init__(self, out: str, fingerprint: str):
        self.path = os.path.join(out, PROGRESS)
        self.fingerprint = fingerprint
        self.stop_after = int(os.environ.get(STOP_AFTER_ENV, "0") or 0)
        self.recorded = 0

    def load(self) -> Dict[int, Dict[str, Any]]:
        """Shards recorded by an earlier run of the same plan whose files still check out."""
        if not os.path.exists(self.path):
            return {}
        with open(self.path, "r", encoding="utf-8") as f:
            lines = f.read().splitlines()
        done: Dict[int, Dict[str, Any]] = {}
        for n, line in enumerate(lines):
            try:
                rec = json.loads(line)
            except ValueError:  # a line cut by the interruption
                continue
            if n == 0 and rec.get("fingerprint") != self.fingerprint:
                if not any('"index"' in x for x in lines[1:]):  # no finished shard: nothing to keep
                    os.unlink(self.path)
                    return {}
                raise ConfigError("--out", f"{os.path.dirname(self.path)} holds an interrupted preparation of "
                                  f"other inputs, tokenizer or options; use another directory or delete it")
            if n == 0 or not isinstance(rec, dict) or "index" not in rec:
                continue
            prefix = os.path.join(os.path.dirname(self.path), rec["name"])
            if all(not shards.check_file(f"{prefix}.{ext}", e) for ext, e in rec.get("files", {}).items()):
                done[int(rec["index"])] = rec
        return done

    def open(self) -> None:
        self.f = open(self.path, "a", encoding="utf-8")
        if self.f.tell() == 0:
            self.f.write(json.dumps({"fingerprint": self.fingerprint}) + "\n")

    def record(self, rec: Dict[str, Any]) -> None:
        self.f.write(json.dumps(rec, sort_keys=True) + "\n")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.recorded += 1
        if self.stop_after and self.recorded >= self.stop_after:
            raise KeyboardInterrupt  # the test hook: as if Ctrl-C came now

    def close(self) -> None:
        self.f.close()


def _check_out_dir(out: str, fingerprint: str) -> Optional[Dict[str, Any]]:
    """The finished manifest when ``out`` already holds this exact preparation; refuses foreign dirs."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError("--out", f"{out} exists and is not a directory")
    if not os.path.isdir(out):
        return None
    if os.path.exists(os.path.join(out, shards.MANIFEST)):
        m = shards.read_manifest(out)
        if m.get("fingerprint") == fingerprint:
            return m
        raise ConfigError("--out", f"{out} already holds a prepared corpus of other inputs, tokenizer or "
                          f"options; use another directory")
    ours = (PROGRESS, shards.MANIFEST)
    foreign = [n for n in os.listdir(out) if not (n.startswith("shard_") or n in ours or ".tmp." in n)]
    if foreign:
        raise ConfigError("--out", f"{out} is not empty and not a preparation ({foreign[0]!r} ...)")
    for n in os.listdir(out):  # leftovers of writes a crash cut short
        if ".tmp." in n:
            os.unlink(os.path.join(out, n))
    return None


def _run_pool(jobs: List[Dict[str, Any]], tokenizer_path: str, workers: int, on_done, bar: Progress) -> None:
    ctx = mp.get_context("spawn")  # no fork of a process that has threads (rich's refresher)
    q = ctx.Queue()
    with ctx.Pool(max(1, min(workers, len(jobs))), initializer=shard_writer.init_worker,
                  initargs=(tokenizer_path, q)) as pool:
        pending = {j["index"]: pool.apply_async(shard_writer.write_shard, (j,)) for j in jobs}
        while pending:
            try:  # wait for news, then take what is there (results are checked below either way)
                msg = q.get(timeout=0.2)
                while True:
                    bar.advance(*msg)
                    msg = q.get_nowait()
            except _queue.Empty:
                pass
            for i in [i for i, r in pending.items() if r.ready()]:
                on_done(pending.pop(i).get())


def prepare(input_specs: Sequence[str], tokenizer: str, out: str, *, field: Optional[str] = None,
            workers: Optional[int] = None, eos_id: Optional[int] = None, eos_token: Optional[str] = None,
            shard_mb: Optional[float] = None, show_progress: bool = True, chat: bool = False,
            train_on: Optional[str] = None, chat_template: Optional[str] = None) -> tuple:
    """Tokenize ``input_specs`` into ``out``; returns (manifest, summary line). ConfigError for bad input.
    ``chat``: conversations with a loss mask (``train_on``, default assistant; corpus/chat.py)."""
    if shard_mb is not None and shard_mb <= 0:
        raise ConfigError("--shard-mb", f"must be > 0, got {shard_mb}")
    for key, value in (("--train-on", train_on), ("--chat-template", chat_template)):
        if value is not None and not chat:
            raise ConfigError(key, "applies to conversations only", "with --chat")
    out_prefix = os.path.abspath(out) + os.sep
    files = [f for f in inputs.expand(input_specs) if not f.startswith(out_prefix)]  # not our own output
    tok_path = os.path.abspath(os.path.join(tokenizer, "tokenizer.json") if os.path.isdir(tokenizer) else tokenizer)
    tok = tk.load(tok_path)
    vocab = tk.vocab_size(tok)
    job_chat = _chat_settings(tokenizer, files, train_on, chat_template, field) if chat else None
    if job_chat and eos_id is None and eos_token is None:  # the tokenizer's own EOS, where it names one
        eos_token = job_chat["special"].get("eos_token") if tok.token_to_id(
            job_chat["special"].get("eos_token", "")) is not None else None
    eos = tk.resolve_eos(tok, eos_id, eos_token)
    dtype = shard_dtype(vocab)
    shard_bytes = auto_shard_bytes(files) if shard_mb is None else max(1, int(shard_mb * 1e6))
    meta = {"tokenizer": {"file": tok_path, "sha256": tk.file_sha256(tok_path), "vocab_size": vocab},
            "eos_id": eos, "dtype": dtype.name, "field": field or ("chat" if chat else "text"),
            "shard_bytes": shard_bytes, "checksum": shards.checksum_algo(), "inputs": files}
    if job_chat:
        meta["loss_mask"] = {"train_on": job_chat["train_on"], "chat_template": job_chat["source"],
                             "chat_template_sha256": job_chat["sha256"]}
    fp = _fingerprint(files, meta)
    meta["fingerprint"] = fp
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError("--out", f"{out} exists and is not a directory")
    with _locked_out(out) as created:
        try:
            return _prepare_into(out, files, meta, tok_path, workers, show_progress, job_chat)
        except ConfigError:
            if created:  # refused: leave no directory behind, so that a fixed command starts clean
                _remove_if_empty(out)
            raise


@contextlib.contextmanager
def _locked_out(out: str):
    """Hold an exclusive lock on the directory `out` (created if missing): a second prepare into
    it waits for the first. Yields whether this call created it."""
    while True:
        created = not os.path.isdir(out)
        os.makedirs(out, exist_ok=True)
        fd = os.open(out, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"mfsdp-data: another mfsdp-data prepare is writing {out}; waiting for it to finish",
                  file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            now, held = os.stat(out), os.fstat(fd)
            same = (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the other prepare removed the directory it had made: lock the new one
    try:
        yield created
    finally:
        os.close(fd)


def _remove_if_empty(out: str) -> None:
    try:
        os.rmdir(out)
    except OSError:
        pass


def _chat_settings(tokenizer: str, files: Sequence[str], train_on: Optional[str], chat_template: Optional[str],
                   field: Optional[str]) -> Dict[str, Any]:
    """What every --chat worker needs (the template's text, not a path: workers render alike);
    refuses inputs that are not JSON lines and a tokenizer without a template, in one line."""
    from .chat import TRAIN_ON, Renderer, load_template

    for f in files:
        if inputs.kind_of(f) != "jsonl":
            raise ConfigError("INPUT", f"{f}: --chat reads conversations from JSON lines", "*.jsonl|*.ndjson")
    train_on = train_on or TRAIN_ON[0]
    template = load_template(tokenizer, chat_template)
    Renderer(template, train_on)  # an unknown --train-on or a template that does not compile: now
    return {"template": template.text, "source": template.source, "sha256": template.sha256,
            "special": template.special, "train_on": train_on, "field": field}


def _prepare_into(out: str, files: List[str], meta: Dict[str, Any], tok_path: str, workers: Optional[int],
                  show_progress: bool, chat: Optional[Dict[str, Any]] = None) -> tuple:
    """prepare() with `out` locked: skip what an earlier run finished, tokenize the rest."""
    fp, field, eos, dtype = meta["fingerprint"], meta["field"], meta["eos_id"], np.dtype(meta["dtype"])
    finished = _check_out_dir(out, fp)
    if finished is not None:
        return finished, "already prepared (same inputs, tokenizer and options)"
    items = inputs.plan(files, field, meta["shard_bytes"])
    ledger = _Ledger(out, fp)
    done = ledger.load()
    jobs = [{"index": i, "pieces": p, "out": out, "field": field, "dtype": dtype.name, "eos_id": eos,
             "algo": meta["checksum"], "chat": chat} for i, p in enumerate(items) if i not in done]
    weight = [sum(p.weight for p in item) for item in items]
    bar = Progress(sum(weight), len(items), sum(weight[i] for i in done), len(done), enabled=show_progress)

    def finished(rec: Dict[str, Any]) -> None:
        ledger.record(rec)
        done[rec["index"]] = rec
        bar.advance(shards=1)

    ledger.open()
    try:
        if jobs:
            _run_pool(jobs, tok_path, workers or default_workers(), finished, bar)
    finally:
        summary = bar.close()
        ledger.close()
    manifest = shards.build_manifest([done[i] for i in range(len(items))], meta)
    if manifest["n_documents"] == 0:
        for rec in done.values():  # shards without a document, and the ledger: nothing to keep
            for ext in rec.get("files", {}):
                _unlink(os.path.join(out, f"{rec['name']}.{ext}"))
        _unlink(ledger.path)
        if chat:
            raise ConfigError("INPUT", f"no conversation to train on in {len(files)} file(s) "
                              f"(skipped {_skipped_text(manifest['skipped']) or 'none'})")
        raise ConfigError("INPUT", f"no documents with text in {len(files)} file(s)"
                          + (f" (no {field!r} field?)" if manifest["skipped"] else ""))
    shards.write_manifest(out, manifest)
    os.unlink(ledger.path)
    return manifest, summary


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# ------------------------------------------------------------------------------- CLI


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the usage too)
        print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="mfsdp-data", description="Prepare, verify and describe token corpora.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    pr = sub.add_parser("prepare", help="tokenize text into a sharded, checksummed corpus")
    pr.add_argument("inputs", nargs="+", metavar="INPUT", help="JSON lines, Parquet, text files, dirs, globs")
    pr.add_argument("--tokenizer", required=True, help="tokenizer.json (or a directory holding one)")
    pr.add_argument("--out", required=True, help="output directory")
    pr.add_argument("--field", default=None,
                    help="JSON/Parquet field with the text (default: text); with --chat, the turns (default: "
                         "messages, conversations or prompt+completion)")
    pr.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: all cores)")
    eos = pr.add_mutually_exclusive_group()
    eos.add_argument("--eos-id", type=int, default=None, help="EOS id appended to every document")
    eos.add_argument("--eos-token", default=None, help="EOS token string (default: a usual one)")
    pr.add_argument("--shard-mb", type=float, default=None,
                    help="MB of input per shard, the unit of parallel work (default: total / 256, within 1..64)")
    pr.add_argument("--quiet", action="store_true", help="no progress output")
    pr.add_argument("--chat", action="store_true",
                    help="JSON lines of conversations, rendered with the tokenizer directory's chat template; "
                         "writes a loss mask beside the tokens")
    pr.add_argument("--train-on", default=None, choices=("assistant", "last", "all"),
                    help="with --chat: the tokens the loss trains on (default: assistant, every assistant turn)")
    pr.add_argument("--chat-template", default=None, metavar="FILE",
                    help="with --chat: a Jinja chat template instead of the tokenizer's")
    ve = sub.add_parser("verify", help="check every shard's size and checksum against the manifest")
    ve.add_argument("dir")
    inf = sub.add_parser("info", help="describe a prepared dir, Megatron .bin/.idx or nanoGPT .bin")
    inf.add_argument("paths", nargs="+")
    inf.add_argument("--eos-id", type=int, default=None, help="split flat .bin files at this id")
    return p


def _cmd_prepare(a) -> int:
    if a.workers is not None and a.workers < 1:
        raise ConfigError("--workers", f"must be >= 1, got {a.workers}")
    t0 = time.perf_counter()
    try:
        m, summary = prepare(a.inputs, a.tokenizer, a.out, field=a.field, workers=a.workers, eos_id=a.eos_id,
                             eos_token=a.eos_token, shard_mb=a.shard_mb, show_progress=not a.quiet, chat=a.chat,
                             train_on=a.train_on, chat_template=a.chat_template)
    except KeyboardInterrupt:
        print(f"mfsdp-data: interrupted after {time.perf_counter() - t0:.0f} s; finished shards are kept, "
              f"rerun the same command to continue", file=sys.stderr, flush=True)
        return 130
    skipped = _skipped_text(m["skipped"])
    print(f"mfsdp-data: {a.out}: {m['n_tokens']:,} tokens, {m['n_documents']:,} documents, "
          f"{len(m['shards'])} shards ({m['dtype']}){_mask_text(m)}; {summary}"
          + (f"; skipped {skipped}" if skipped else ""))
    return 0


def _skipped_text(skipped: Dict[str, int]) -> str:
    """'3 no_assistant (no assistant turn to train on), 1 bad_json (...)': what was left out, and why."""
    from .chat import ROW_PROBLEMS

    return ", ".join(f"{v} {k}" + (f" ({ROW_PROBLEMS[k]})" if k in ROW_PROBLEMS else "")
                     for k, v in sorted(skipped.items()))


def _mask_text(m: Dict[str, Any]) -> str:
    """', loss mask on 41.3% of the tokens (train_on=assistant)' for a corpus with one, else ''."""
    mask = m.get("loss_mask")
    if not mask or not m.get("n_tokens"):
        return ""
    share = 100.0 * int(m.get("n_targets", 0)) / int(m["n_tokens"])
    return f", loss mask on {share:.1f}% of the tokens (train_on={mask.get('train_on')})"


def _cmd_verify(a) -> int:
    try:
        problems = shards.verify(a.dir)
    except ValueError as e:
        raise ConfigError("DIR", str(e)) from None
    for p in problems:
        print(f"mfsdp-data: {p}", file=sys.stderr)
    if problems:
        return 1
    print(f"mfsdp-data: {a.dir}: all shards match the manifest")
    return 0


def _cmd_info(a) -> int:
    from .sources import resolve
    from .stream import TokenStream

    for path in a.paths:
        src = resolve(path, key="PATH", eos_id=a.eos_id, cache_dir=None if a.eos_id is None else _cache_dir())
        st = TokenStream(src.shards)
        mask = _mask_text({"loss_mask": src.loss_mask, "n_targets": src.n_targets, "n_tokens": st.n_tokens})
        print(f"{path}: {'+'.join(sorted(set(src.kinds)))}, {len(src.shards)} shard(s), {st.n_tokens:,} tokens, "
              f"{st.n_docs:,} documents, dtype {src.shards[0].dtype.name if src.shards else '-'}, "
              f"vocab {src.vocab_size or 'unknown'}, eos {src.eos_id if src.eos_id is not None else a.eos_id}{mask}")
    return 0


def _cache_dir() -> str:
    from .cache import cache_dir

    return cache_dir()


def main(argv: Optional[List[str]] = None) -> int:
    a = _parser().parse_args(argv)
    try:
        return {"prepare": _cmd_prepare, "verify": _cmd_verify, "info": _cmd_info}[a.cmd](a)
    except ConfigError as e:
        print(f"mfsdp-data {a.cmd}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:  # an unreadable file, a full disk: still one line
        first = first_line(e)
        print(f"mfsdp-data {a.cmd}: error: {type(e).__name__}: {first}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
