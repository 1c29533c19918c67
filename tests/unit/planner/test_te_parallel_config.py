"""te_gpt tensor/sequence/context parallelism: what validation accepts and refuses (torch-free config
layer; Transformer Engine need not be installed), and te_parallel's shard rule on CPU tensors."""

import pytest

from helpers import refused
from mfsdp_launch.planner import prepare
from mfsdp_launch.engines import ENGINES
from mfsdp_launch.models import FAMILIES
from mfsdp_launch.models.family import Parallel

MFSDP = ["model=te_gpt", "model.preset=tiny", "engine=megatron_fsdp", "launcher.dry_run=true",
         "train.seq_len=64"]


def accepted(*overrides):
    cfg, _ = prepare([*MFSDP, *overrides], check_hardware=False)
    return cfg


def test_support_answers():
    """Each family's one answer per engine: what validation, the memory estimate and the runtime read."""
    mfsdp, fsdp2 = ENGINES["megatron_fsdp"], ENGINES["fsdp2"]
    te = FAMILIES["te_gpt"].support(mfsdp)
    assert (te.tp, te.cp, te.splits_over_tp, te.splits_sequence) == (Parallel.TE, Parallel.TE, True, True)
    assert FAMILIES["te_gpt"].support(fsdp2).tp == Parallel.NONE == FAMILIES["te_gpt"].support(fsdp2).cp
    gpt = FAMILIES["gpt"].support(fsdp2)
    assert (gpt.tp, gpt.cp) == (Parallel.DTENSOR, Parallel.ALLGATHER)  # all-gather attention, not TE
    assert FAMILIES["gpt"].support(mfsdp).tp == Parallel.NONE and FAMILIES["gpt"].support(mfsdp).splits_sequence
    toy = FAMILIES["toy_cnn"].support(mfsdp)
    assert toy.tp == Parallel.REPLICATE and not toy.splits_over_tp and not toy.splits_sequence
    assert FAMILIES["toy_cnn"].support(fsdp2).tp == Parallel.NONE
    assert FAMILIES["custom"].support(fsdp2).activation_checkpointing  # its fsdp_unit_modules (issue 26)
    assert not FAMILIES["toy_cnn"].support(fsdp2).activation_checkpointing


@pytest.mark.parametrize("mesh", [["mesh.tp=2"], ["mesh.cp=2"], ["mesh.tp=2", "mesh.cp=2"]])
def test_te_gpt_tp_and_cp_under_megatron_fsdp_are_accepted(mesh):
    n = 4 if len(mesh) == 2 else 2
    cfg = accepted(*mesh, f"launcher.nproc_per_node={n}")
    assert cfg.mesh.dp_shard == 1


@pytest.mark.parametrize("overrides,key,words", [
    # gpt's tp rules, written once (GPTFamily.check_tp_dims) and applied to te_gpt too
    (["mesh.tp=2", "model.n_heads=4", "model.n_kv_heads=1", "model.dim=64"], "mesh.tp", "key/value heads"),
    (["mesh.tp=2", "model.ffn_dim=129"], "mesh.tp", "model.ffn_dim=129"),
    (["mesh.tp=4", "model.n_heads=2", "model.dim=64", "launcher.nproc_per_node=4"], "mesh.tp", "attention heads"),
    # TE's tensor-parallel shards are not whole tensors for FSDP2's checkpoints
    (["mesh.tp=2", "engine=fsdp2"], "mesh.tp", "inside its TE layers"),
    (["mesh.cp=2", "engine=fsdp2"], "mesh.cp", "engine=megatron_fsdp only"),
    # cp: two load-balanced chunks per rank; then sequence parallelism splits seq_len/cp over tp
    (["mesh.cp=2", "train.seq_len=66"], "train.seq_len", "2*mesh.cp=4"),
    (["mesh.cp=2", "mesh.tp=4", "train.seq_len=36", "launcher.nproc_per_node=8"], "train.seq_len",
     "mesh.cp*mesh.tp=8"),
])
def test_refusals(overrides, key, words):
    n = [o for o in overrides if o.startswith("launcher.nproc_per_node")] or ["launcher.nproc_per_node=2"]
    e = refused(*MFSDP, *n, *[o for o in overrides if not o.startswith("launcher.nproc_per_node")])
    assert e.key == key and words in str(e), str(e)


def test_tp_slice_keeps_glu_halves_and_reassembles():
    torch = pytest.importorskip("torch")
    from mfsdp_launch.models.llama.te_parallel import tp_slice

    full = torch.arange(8.0).repeat_interleave(3).view(8, 3)  # rows 0..3 gate, 4..7 up
    shards = [tp_slice(full, "fc1_weight", 0, r, 2) for r in range(2)]
    assert shards[0][:, 0].tolist() == [0, 1, 4, 5] and shards[1][:, 0].tolist() == [2, 3, 6, 7]
    rows = [tp_slice(full, "layernorm_qkv.weight", 0, r, 2)[:, 0].tolist() for r in range(2)]
    assert rows == [[0, 1, 2, 3], [4, 5, 6, 7]]  # contiguous: TE's interleaved qkv keeps whole groups
    cols = tp_slice(full.t(), "fc2_weight", 1, 1, 2)
    assert cols.shape == (3, 4) and cols[0].tolist() == [4, 5, 6, 7]
    assert tp_slice(full, "fc1_weight", 0, 0, 1) is full
