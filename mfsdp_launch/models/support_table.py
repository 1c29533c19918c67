"""The support table of docs/models.md: which family runs which tool under which engine, printed
from each family's `support(engine)` answer (models/family.py), the one that validation, the
memory estimate and the runtime read. tests/unit/models/test_support_table.py regenerates it and
fails when docs/models.md differs; `MFSDP_RECORD_DOCS=1` on that test rewrites the file."""

from __future__ import annotations

from typing import List

from ..core.fp8 import LINEAR_RECIPES, TE_RECIPES
from ..core.parallel import Parallel
from ..engines import ENGINES
from . import FAMILIES

BEGIN = ("<!-- support table: generated from each family's support(engine); rewrite with "
         "MFSDP_RECORD_DOCS=1 python3 -m pytest tests/unit/models/test_support_table.py -->")
END = "<!-- end of the support table -->"

COLUMNS = ("model", "engine", "mesh.tp > 1", "mesh.cp > 1", "activation checkpointing", "data.doc_mask",
           "fp8.recipe", "train.cpu_offload", "mesh.ep > 1")

MODE_TEXT = {Parallel.NONE: "no", Parallel.REPLICATE: "replicated", Parallel.DTENSOR: "DTensor TP + SP",
             Parallel.ALLGATHER: "all-gather K/V", Parallel.TE: "TE layers"}


def _fp8_text(recipes) -> str:
    parts = []
    te = sorted(str(r) for r in TE_RECIPES if str(r) in recipes)
    ao = sorted(str(r) for r in LINEAR_RECIPES if str(r) in recipes)
    if te:
        parts.append("TE: " + ", ".join(te))
    if ao:
        parts.append(", ".join(ao))
    return "; ".join(parts) or "no"


def rows() -> List[List[str]]:
    out = []
    for name, fam in FAMILIES.items():
        for engine, caps in ENGINES.items():
            s = fam.support(caps)
            out.append([f"`{name}`", f"`{engine}`", MODE_TEXT[s.tp], MODE_TEXT[s.cp],
                        "full, selective" if s.activation_checkpointing else "no", "yes" if s.doc_mask else "no",
                        _fp8_text(s.fp8), "yes" if s.cpu_offload else "no",
                        f"experts ({fam.experts_from})" if s.expert_parallel else "no"])
    return out


def render() -> str:
    """The table, between its markers, as docs/models.md holds it."""
    lines = [BEGIN, "", "| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in rows()]
    return "\n".join(lines + ["", END])


def replace_in(text: str) -> str:
    """`text` (docs/models.md) with the table between the markers regenerated."""
    start, end = text.index(BEGIN), text.index(END) + len(END)
    return text[:start] + render() + text[end:]


def current_in(text: str) -> str:
    """The table part of `text`, markers included ('' if the markers are missing)."""
    if BEGIN not in text or END not in text:
        return ""
    return text[text.index(BEGIN):text.index(END) + len(END)]
