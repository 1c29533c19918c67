"""The ``tokenizers`` library behind ``prepare``: loading, vocab size, EOS, and a tiny BPE trainer.

``train_bpe`` exists so that tests, the benchmark and demos build a tokenizer from local text
(nothing is downloaded).
"""

from __future__ import annotations

import hashlib
import os
from typing import Iterable, Optional

from ..core.errors import ConfigError
from ..core.names import first_line

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def load(path: str, key: str = "--tokenizer"):
    """A ``tokenizers.Tokenizer`` from a ``tokenizer.json`` (or a directory holding one)."""
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise ConfigError(key, f"no tokenizer file {path!r}", "a tokenizer.json or a directory holding one")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(key, "needs the 'tokenizers' package (pip install 'mfsdp-launch[data]')") from None
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # the library raises plain Exception for a malformed file
        first = first_line(e)
        raise ConfigError(key, f"cannot load {path!r}: {first}") from None


def vocab_size(tok) -> int:
    """Ids the tokenizer can emit: max id + 1 over its vocabulary and added tokens."""
    ids = tok.get_vocab(with_added_tokens=True).values()
    return max(max(ids, default=-1) + 1, tok.get_vocab_size(with_added_tokens=True))


def resolve_eos(tok, eos_id: Optional[int], eos_token: Optional[str]) -> int:
    """The EOS id: ``eos_id``, else ``eos_token``'s id, else the first known EOS token present."""
    n = vocab_size(tok)
    if eos_id is not None:
        if not 0 <= eos_id < n:
            raise ConfigError("--eos-id", f"{eos_id} is outside the tokenizer's vocab [0, {n})")
        return int(eos_id)
    names = [eos_token] if eos_token else list(EOS_CANDIDATES)
    for name in names:
        i = tok.token_to_id(name)
        if i is not None:
            return int(i)
    if eos_token:
        raise ConfigError("--eos-token", f"{eos_token!r} is not in the tokenizer's vocabulary")
    raise ConfigError("--eos-token", "the tokenizer has none of the usual EOS tokens; name one or give --eos-id",
                      EOS_CANDIDATES)


def train_bpe(texts: Iterable[str], vocab: int, out_path: str, eos: str = "<|endoftext|>") -> str:
    """Train a byte-level BPE tokenizer of ``vocab`` ids on ``texts``, save it to ``out_path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[eos], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(out_path)
    return out_path
