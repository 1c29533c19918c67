"""TE's fused SwiGLU fc1 under tp (engines/glu_layout.py): DCP sees the tp=1 [gate | up] rows.

Real DCP on gloo: four child processes hold fc1 as Megatron-FSDP does under dp_shard=2 x tp=2
(tp shards [gate_r | up_r] concatenated, unevenly row-sharded over dp, Megatron-FSDP's own chunk
metadata), load it from a checkpoint this process wrote as one plain tp=1 tensor, and save it for
this process to read back as one. The children are gloo ranks (helpers.run_ranks) running _child,
both directions in one spawn (four processes importing torch cost more than the check itself).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import run_ranks

FFN, DIM, TP, DP = 6, 2, 2, 2
DP_ROWS = (4, 2)  # uneven dp split of each tp rank's 2*FFN/TP = 6 rows; rank 0's 4 cross gate|up


def tp1_weight() -> torch.Tensor:
    return torch.arange(2 * FFN * DIM, dtype=torch.float32).view(2 * FFN, DIM)


def expected_local(tp_rank: int, dp_rank: int) -> torch.Tensor:
    from mfsdp_launch.models.llama.te_parallel import tp_slice

    shard = tp_slice(tp1_weight(), "fc1_weight", 0, tp_rank, TP)
    start = sum(DP_ROWS[:dp_rank])
    return shard[start: start + DP_ROWS[dp_rank]]


def _child(rank: int, world: int, workdir: str) -> None:
    """Load the tp=1 checkpoint `workdir`/tp1 into a zeroed shard (asserting its rows), then save a
    freshly filled shard (independent of the load) to `workdir`/tp2."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from megatron_fsdp.uneven_dtensor import update_uneven_dtensor_chunk_metadata
    from mfsdp_launch.engines.glu_layout import canonicalize

    mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
    dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    mesh._shard_order = [1, 0]  # as Megatron-FSDP marks (tp shard, then dp shard inside it)

    def fc1(local):
        dt = DTensor.from_local(local, mesh, [Shard(0), Shard(0)], shape=(2 * FFN, DIM),
                                stride=(DIM, 1), run_check=False)
        update_uneven_dtensor_chunk_metadata(dt)
        canonicalize(dt, TP)
        return dt

    loaded = torch.zeros(DP_ROWS[dp_rank], DIM)
    dcp.load({"fc1_weight": fc1(loaded)}, checkpoint_id=str(Path(workdir) / "tp1"))
    assert torch.equal(loaded, expected_local(tp_rank, dp_rank)), (rank, loaded)
    dcp.save({"fc1_weight": fc1(expected_local(tp_rank, dp_rank).clone())},
             checkpoint_id=str(Path(workdir) / "tp2"))


@pytest.mark.slow
def test_tp1_save_loads_into_tp2_shards_and_tp2_save_reads_back_as_the_tp1_tensor(tmp_path):
    """Both directions in one spawn of the four ranks: each child asserts the rows it loaded from
    this process's tp=1 save; this process then reads the children's tp=2 save as the tp=1 tensor."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"fc1_weight": tp1_weight()}, checkpoint_id=str(tmp_path / "tp1"), no_dist=True)
    run_ranks(_child, DP * TP, tmp_path)  # each child asserts its loaded rows
    full = {"fc1_weight": torch.zeros(2 * FFN, DIM)}
    dcp.load(full, checkpoint_id=str(tmp_path / "tp2"), no_dist=True)
    assert torch.equal(full["fc1_weight"], tp1_weight())


def test_glu_chunks_and_gathered_order():
    from mfsdp_launch.engines.glu_layout import glu_chunks, glu_to_tp1

    # tp=2, ffn=6: block of 6 rows per tp rank, gate half 3
    assert glu_chunks(0, 4, FFN, TP) == [(0, 3, 0), (3, 1, 6)]
    assert glu_chunks(10, 2, FFN, TP) == [(0, 2, 10)]  # tp rank 1, up rows 1..2 -> 6+3+1
    assert glu_chunks(6, 3, FFN, TP) == [(0, 3, 3)]
    assert glu_chunks(5, 0, FFN, TP) == []
    concatenated = torch.cat([expected_local(r, d) for r in range(TP) for d in range(DP)])
    assert torch.equal(glu_to_tp1(concatenated, TP), tp1_weight())

