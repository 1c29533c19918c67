"""Dtype names: the one enum every config key and runtime mapping uses (torch-free)."""

from __future__ import annotations

from .choice import Choice


class Dtype(Choice):
    """A config dtype. `str` mixin: `cfg.precision.compute_dtype == "bf16"` holds."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"
    fp64 = "fp64"

    @property
    def bytes(self) -> int:
        return _BYTES[self]

    @property
    def torch_name(self) -> str:
        """The attribute of `torch` holding this dtype ('bfloat16' for bf16)."""
        return _TORCH_NAMES[self]


_BYTES = {Dtype.fp32: 4, Dtype.bf16: 2, Dtype.fp16: 2, Dtype.fp64: 8}
_TORCH_NAMES = {Dtype.fp32: "float32", Dtype.bf16: "bfloat16", Dtype.fp16: "float16", Dtype.fp64: "float64"}

# optim.state_dtype: AdamW's moments (components/adamw.py rounds bf16 ones; fp16 would overflow).
OPTIM_STATE_DTYPES = (Dtype.fp32, Dtype.bf16)

# Main weights in this precision or wider keep small updates (FSDP2 shards these directly).
WIDE_DTYPES = (Dtype.fp32, Dtype.fp64)


def dtype_bytes(name) -> int:
    return Dtype(name).bytes
