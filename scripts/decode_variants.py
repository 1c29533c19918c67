"""The fused decoder's variants that scripts/profile_generate.py and scripts/bench_generate.py compare.

A setting is a decoder with `+name=value` changes to the fused step (models/llama/fused_decode.py):

    triton                    as shipped
    triton+pdl=2+early=2      each kernel lets the next launch at its start, two weight blocks early
    triton+bl=32+waves=4      attention tiles of 32 cache rows, slices for four waves of programs
    triton+tune=0             the autotuner's tiles, not re-picked in the graph (decode_tuning.py)

`pdl` is decode_kernels' PDL mode (0 none, 1 after the wait, 2 at the start); the others are
FusedDecoder's class attributes below.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

ALIASES = {"triton_nopdl": "triton+pdl=0", "triton_early": "triton+pdl=2"}
ATTRS = {"early": "EARLY", "bl": "BLOCK_L", "waves": "WAVES", "tune": "GRAPH_TUNE"}


def parse(setting: str) -> Tuple[str, Dict[str, int]]:
    """(decoder, {change: value}) of a setting."""
    base, *changes = ALIASES.get(setting, setting).split("+")
    out = {}
    for change in changes:
        name, _, value = change.partition("=")
        if name not in ATTRS and name != "pdl":
            raise SystemExit(f"{setting}: no change {name!r} (allowed: pdl, {', '.join(ATTRS)})")
        out[name] = int(value)
    return base, out


def apply(changes: Dict[str, int]) -> Callable[[], None]:
    """Makes `changes` the fused step's until the returned undo is called."""
    from mfsdp_launch.models.llama import fused_decode

    cls = fused_decode.FusedDecoder
    saved = {attr: getattr(cls, attr) for attr in ATTRS.values()}
    shipped_pdl = fused_decode._pdl
    for name, value in changes.items():
        if name == "pdl":
            fused_decode._pdl = lambda device, mode=value: mode
        else:
            setattr(cls, ATTRS[name], bool(value) if name == "tune" else value)

    def undo():
        for attr, value in saved.items():
            setattr(cls, attr, value)
        fused_decode._pdl = shipped_pdl

    return undo
