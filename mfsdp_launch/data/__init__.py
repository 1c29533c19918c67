"""Deterministic, position-addressed token batches, and the data rules the launcher checks.

    layout.py   the global sample index: which samples a rank reads at (step, micro-batch)
    text.py     data=text: local text files tokenized once into a cached corpus directory
    batches.py  TokenBatches: one rank's micro-batches for synthetic, text and tokens data
    check.py    check_data_config, check_data_integrity: the launcher's cheap, torch-free checks

Sample ``g`` is a pure function of ``(seed, g)`` and the corpus, so a resume (even at another
data-parallel size) continues bitwise with no loader state. The corpora themselves (formats,
blends, packing, document masks) live in ``mfsdp_launch.corpus``; docs/data.md is the guide.
Importing this package imports nothing; each name's module comes on first use.
"""

import importlib

# Each name's module, imported on first use (PEP 562): the launcher's checks (check.py, text.py's
# rules) run without numpy, which batches.py and layout.py need, so a dry run starts faster.
_HOME = {
    "TokenBatches": "batches", "open_dataset": "batches",
    "check_data_config": "check", "check_data_integrity": "check", "has_validation": "check",
    "loss_masked_source": "check",
    "microbatch_start": "layout", "sample_rng": "layout", "samples_per_step": "layout",
    "val_batch_start": "layout",
    "BYTE_VOCAB": "text", "SEPARATOR": "text", "STDLIB_SKIP_DIRS": "text", "build_token_cache": "text",
    "cache_dir_for": "text", "resolve_text_files": "text", "stdlib_dir": "text", "token_dtype": "text",
    "tokenizer_vocab_size": "text",
}
__all__ = list(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    globals()[name] = value
    return value
