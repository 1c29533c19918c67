import pytest

from mfsdp_launch.core.errors import ConfigError
from mfsdp_launch.mesh import ParallelDims
from mfsdp_launch.core.schema import MeshConfig


def dims(dp_outer=1, dp_shard=-1, cp=1, tp=1, world=8):
    return ParallelDims.from_config(MeshConfig(dp_outer=dp_outer, dp_shard=dp_shard, cp=cp, tp=tp), world)


def test_dp_shard_inferred():
    d = dims(dp_outer=2, world=8)
    assert d.shape == (2, 4, 1, 1)
    assert d.dp_size == 8 and d.shard_size == 4 and d.dp_shard_dim == "dp_shard"


def test_product_must_match_world():
    with pytest.raises(ConfigError) as e:
        dims(dp_shard=3, world=4)
    assert e.value.key == "mesh" and "world size is 4" in str(e.value)


def test_inference_needs_divisibility():
    with pytest.raises(ConfigError) as e:
        dims(dp_outer=3, world=8)
    assert e.value.key == "mesh.dp_shard"


@pytest.mark.parametrize("key", ["dp_outer", "cp", "tp"])
def test_nonpositive_degrees_refused(key):
    with pytest.raises(ConfigError) as e:
        dims(**{key: 0})
    assert e.value.key == f"mesh.{key}"


def test_coords_are_row_major_like_init_device_mesh():
    d = dims(dp_outer=2, dp_shard=2, cp=1, tp=2, world=8)
    assert d.coords(0) == {"dp_outer": 0, "dp_shard": 0, "cp": 0, "tp": 0}
    assert d.coords(1) == {"dp_outer": 0, "dp_shard": 0, "cp": 0, "tp": 1}
    assert d.coords(2) == {"dp_outer": 0, "dp_shard": 1, "cp": 0, "tp": 0}
    assert d.coords(7) == {"dp_outer": 1, "dp_shard": 1, "cp": 0, "tp": 1}
    for r in range(8):
        assert d._rank_of(d.coords(r)) == r


def test_groups_and_flattened_dims():
    d = dims(dp_outer=2, dp_shard=2, cp=2, tp=1, world=8)
    g = d.groups_of(5)  # coords (1, 0, 1, 0)
    assert g["tp"] == [5]
    assert g["cp"] == [4, 5]
    assert g["dp_shard"] == [5, 7]
    assert g["dp_shard_cp"] == [4, 5, 6, 7]
    assert g["dp"] == [1, 3, 5, 7]
    assert g["hsdp"] == list(range(8))
    assert d.dp_shard_dim == "dp_shard_cp"


def test_tp_and_cp_ranks_share_dp_rank():
    d = dims(dp_outer=1, dp_shard=2, cp=2, tp=2, world=8)
    assert {d.dp_rank(r) for r in d.group_of(0, ("cp", "tp"))} == {0}
    assert sorted({d.dp_rank(r) for r in range(8)}) == [0, 1]


def test_rank_table_nodes():
    rows = dims(dp_outer=2, world=8).rank_table(nproc_per_node=4)
    assert [r["node"] for r in rows] == [0] * 4 + [1] * 4
    assert [r["local_rank"] for r in rows] == [0, 1, 2, 3] * 2
    assert [r["dp_outer"] for r in rows] == [0] * 4 + [1] * 4


def test_cross_node_warnings():
    # dp_shard=8 over 2 nodes of 4: the shard groups leave the node.
    assert any("dp_shard" in w for w in dims(dp_outer=1, world=8).cross_node_warnings(4))
    # dp_outer across nodes, dp_shard inside: the HSDP layout, no warning.
    assert dims(dp_outer=2, world=8).cross_node_warnings(4) == []
