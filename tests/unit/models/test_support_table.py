"""docs/models.md's support table is generated from each family's support(engine) answer
(models/support_table.py) and cannot drift: this test regenerates it and fails on a difference.
`MFSDP_RECORD_DOCS=1 python3 -m pytest tests/unit/models/test_support_table.py` rewrites the file.
Validation reads the same answer: the table's "no" cells are refusals."""

import os

import pytest

from helpers import ROOT, refused
from mfsdp_launch.engines import ENGINES
from mfsdp_launch.models import FAMILIES
from mfsdp_launch.models import support_table as T

DOC = ROOT / "docs" / "models.md"


def test_docs_models_md_holds_the_generated_table():
    text = DOC.read_text()
    if os.environ.get("MFSDP_RECORD_DOCS") == "1":
        DOC.write_text(T.replace_in(text))
        text = DOC.read_text()
    assert T.current_in(text) == T.render(), (
        "docs/models.md's support table differs from the families' support(engine) answers; rewrite it with "
        "MFSDP_RECORD_DOCS=1 python3 -m pytest tests/unit/models/test_support_table.py")
    assert len(T.rows()) == len(FAMILIES) * len(ENGINES)


# Cheap families (no probe process): each "no" in the table is a one-line refusal before spawning.
@pytest.mark.parametrize("model", ["gpt", "toy_cnn"])
def test_the_table_is_what_validation_refuses(model):
    for engine, caps in ENGINES.items():
        s = FAMILIES[model].support(caps)
        base = [f"model={model}", f"engine={engine}", "launcher.dry_run=true"]
        if not s.activation_checkpointing:
            assert refused(*base, "model.activation_checkpointing=full").key == "model.activation_checkpointing"
        if not s.cpu_offload:
            assert refused(*base, "train.cpu_offload=true").key == "train.cpu_offload"
        if "torchao_rowwise" not in s.fp8:
            assert refused(*base, "fp8.recipe=torchao_rowwise").key == "fp8.recipe"
