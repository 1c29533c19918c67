"""Deterministic, position-addressed token batches, and the data rules the launcher checks.

    layout.py   the global sample index: which samples a rank reads at (step, micro-batch)
    text.py     data=text: local text files tokenized once into a cached corpus directory
    batches.py  TokenBatches: one rank's micro-batches for synthetic, text and tokens data
    check.py    check_data_config, check_data_integrity: the launcher's cheap, torch-free checks

Sample ``g`` is a pure function of ``(seed, g)`` and the corpus, so a resume (even at another
data-parallel size) continues bitwise with no loader state. The corpora themselves (formats,
blends, packing, document masks) live in ``mfsdp_launch.corpus``; docs/data.md is the guide.
Importing this package imports numpy only.
"""

from .batches import TokenBatches, open_dataset
from .check import check_data_config, check_data_integrity, has_validation, loss_masked_source
from .layout import microbatch_start, sample_rng, samples_per_step, val_batch_start
from .text import (BYTE_VOCAB, SEPARATOR, STDLIB_SKIP_DIRS, build_token_cache, cache_dir_for, resolve_text_files, stdlib_dir, token_dtype, tokenizer_vocab_size)

__all__ = [
    "TokenBatches", "open_dataset", "check_data_config", "check_data_integrity", "has_validation", "loss_masked_source", "samples_per_step",
    "microbatch_start", "val_batch_start", "sample_rng", "resolve_text_files", "tokenizer_vocab_size",
    "build_token_cache", "cache_dir_for", "token_dtype", "stdlib_dir", "STDLIB_SKIP_DIRS", "SEPARATOR",
    "BYTE_VOCAB",
]
