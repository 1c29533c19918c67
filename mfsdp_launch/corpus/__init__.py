"""Token corpora of any size: ``mfsdp-data prepare``, readers for prepared, Megatron and nanoGPT
files, weighted blends, document packing and masks. See docs/data.md.

Importing this package imports numpy only (torch is imported inside the mask functions,
``tokenizers`` and ``pyarrow`` inside ``prepare``).
"""

from .dataset import SPLITS, TokenDataset
from .doc_mask import block_causal_mask, cu_seqlens, doc_ids_from_eos, flex_block_mask, position_ids
from .shards import verify
from .sources import PACKS, Source, check_integrity, check_sources, resolve

__all__ = [
    "TokenDataset", "SPLITS", "PACKS", "check_integrity", "check_sources", "resolve", "Source", "verify",
    "block_causal_mask", "flex_block_mask", "position_ids", "cu_seqlens", "doc_ids_from_eos",
]
