"""The 4-D device mesh (dp_outer, dp_shard, cp, tp) and its flattened dims, and the expert mesh.

Degrees are validated first (pure Python, used by the dry run); the torch DeviceMesh is built
lazily, in `build`, `build_expert_mesh` and `expert_hsdp_mesh`, the only places that touch
torch's private `_flatten` / `_unflatten`.

Expert parallelism (`mesh.ep`) is no mesh dimension of its own: it borrows from dp_shard x cp, as
torchtitan and Megatron-Core do. The dp_shard x cp ranks of a replica (flattened, cp fastest) split
into `ep`-sized consecutive groups, the ep groups, which hold different experts and trade tokens;
the ranks at the same place of each ep group form the expert-data-parallel (edp) group, which
shards (FSDP) and averages one set of experts. Dense weights keep their dp_shard x cp sharding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Tuple

from .core.errors import ConfigError

DIMS = ("dp_outer", "dp_shard", "cp", "tp")
# Flattened dims, as the engine expects them (names are ours; Megatron-FSDP takes any names).
FLATTENED = {
    "dp": ("dp_outer", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "hsdp": ("dp_outer", "dp_shard", "cp"),
}


def world_size(launcher_cfg) -> int:
    """Ranks of the job: nodes x processes per node."""
    return launcher_cfg.nnodes * launcher_cfg.nproc_per_node


@dataclass(frozen=True)
class ParallelDims:
    dp_outer: int
    dp_shard: int
    cp: int
    tp: int
    ep: int = 1  # borrows from dp_shard x cp (the module docstring)

    @classmethod
    def from_config(cls, mesh_cfg, world_size: int) -> "ParallelDims":
        """Check the degrees against the world size; dp_shard=-1 takes what is left."""
        sizes = {d: int(getattr(mesh_cfg, d)) for d in DIMS}
        for name, value in sizes.items():
            if value < 1 and not (name == "dp_shard" and value == -1):
                allowed = "a positive integer" + (", or -1 to infer" if name == "dp_shard" else "")
                raise ConfigError(f"mesh.{name}", f"must be >= 1, got {value}", allowed)
        if sizes["dp_shard"] == -1:
            rest = sizes["dp_outer"] * sizes["cp"] * sizes["tp"]
            if world_size % rest:
                raise ConfigError(
                    "mesh.dp_shard",
                    f"cannot infer: world size {world_size} is not divisible by "
                    f"dp_outer*cp*tp = {rest}",
                    f"dp_outer*cp*tp dividing {world_size}",
                )
            sizes["dp_shard"] = world_size // rest
        product = math.prod(sizes.values())
        if product != world_size:
            shape = "x".join(str(sizes[d]) for d in DIMS)
            raise ConfigError(
                "mesh",
                f"dp_outer*dp_shard*cp*tp = {shape} = {product} but the world size is {world_size} "
                f"(launcher.nnodes * launcher.nproc_per_node)",
                f"degrees whose product is {world_size}, or mesh.dp_shard=-1",
            )
        ep = int(getattr(mesh_cfg, "ep", 1))
        shard = sizes["dp_shard"] * sizes["cp"]
        if ep < 1 or shard % ep:
            raise ConfigError("mesh.ep", f"{ep} does not divide mesh.dp_shard*mesh.cp = {shard} (expert "
                              "parallelism borrows those ranks)", f"a divisor of {shard}")
        return cls(**sizes, ep=ep)

    @property
    def shape(self) -> Tuple[int, int, int, int]:
        return (self.dp_outer, self.dp_shard, self.cp, self.tp)

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def dp_size(self) -> int:
        """Ranks that see different data."""
        return self.dp_outer * self.dp_shard

    @property
    def shard_size(self) -> int:
        """Ranks one parameter is sharded over inside a replica (dp_shard x cp)."""
        return self.dp_shard * self.cp

    @property
    def dp_shard_dim(self) -> str:
        return "dp_shard_cp" if self.cp > 1 else "dp_shard"

    @property
    def edp(self) -> int:
        """Ranks of a replica that hold (and shard) the same experts: dp_shard x cp / ep."""
        return self.shard_size // self.ep

    def expert_groups_of(self, rank: int) -> Dict[str, List[int]]:
        """{"ep": the ranks trading tokens with `rank`, "edp": those sharing its experts within its
        replica (dp_outer extends it across replicas, as for dense weights)}."""
        c = self.coords(rank)
        flat = c["dp_shard"] * self.cp + c["cp"]  # position in the flattened dp_shard x cp dim
        base = flat - flat % self.ep

        def rank_at(position: int) -> int:
            return self._rank_of(dict(c, dp_shard=position // self.cp, cp=position % self.cp))

        return {"ep": [rank_at(base + i) for i in range(self.ep)],
                "edp": sorted(rank_at(flat % self.ep + j * self.ep) for j in range(self.edp))}

    def coords(self, rank: int) -> Dict[str, int]:
        """Row-major coordinates, the layout init_device_mesh uses."""
        out = {}
        for name, size in zip(reversed(DIMS), reversed(self.shape)):
            out[name] = rank % size
            rank //= size
        return {d: out[d] for d in DIMS}

    def dp_rank(self, rank: int) -> int:
        c = self.coords(rank)
        return c["dp_outer"] * self.dp_shard + c["dp_shard"]

    def _rank_of(self, coords: Dict[str, int]) -> int:
        rank = 0
        for name, size in zip(DIMS, self.shape):
            rank = rank * size + coords[name]
        return rank

    def group_of(self, rank: int, dims: Tuple[str, ...]) -> List[int]:
        """The ranks sharing every coordinate with `rank` except along `dims`."""
        base = self.coords(rank)
        members = [dict(base)]
        for d in dims:
            size = self.shape[DIMS.index(d)]
            members = [dict(m, **{d: i}) for m in members for i in range(size)]
        return sorted(self._rank_of(m) for m in members)

    def groups_of(self, rank: int) -> Dict[str, List[int]]:
        groups = {d: self.group_of(rank, (d,)) for d in DIMS}
        groups.update({name: self.group_of(rank, dims) for name, dims in FLATTENED.items()})
        return groups

    def rank_table(self, nproc_per_node: int) -> List[Dict[str, int]]:
        rows = []
        for rank in range(self.world_size):
            row = {"rank": rank, "node": rank // nproc_per_node, "local_rank": rank % nproc_per_node}
            row.update(self.coords(rank))
            row["dp_rank"] = self.dp_rank(rank)
            rows.append(row)
        return rows

    def cross_node_warnings(self, nproc_per_node: int) -> List[str]:
        """Dims whose groups span nodes: their collectives leave NVLink."""
        warnings = []
        for dim in ("tp", "cp", "dp_shard"):
            for rank in range(self.world_size):
                nodes = {r // nproc_per_node for r in self.group_of(rank, (dim,))}
                if len(nodes) > 1:
                    warnings.append(
                        f"mesh.{dim}={getattr(self, dim)} groups span {len(nodes)} nodes "
                        f"(nproc_per_node={nproc_per_node}): their collectives leave NVLink"
                    )
                    break
        return warnings

    def build(self, device_type: str):
        """Create the DeviceMesh with the flattened dims. Needs an initialized process group."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=DIMS)
        for name, dims in FLATTENED.items():
            mesh[dims]._flatten(name)
        return mesh


def build_expert_mesh(mesh, dims: ParallelDims):
    """The expert mesh (dp_outer, edp, ep) from the same root as `mesh`: the dp_shard x cp dim
    unflattened into (edp, ep), ep fastest (the module docstring). DTensor expert weights placed
    on its "ep" dim and FSDP over its "edp" (or "dp_outer", "edp") dims compose as TP and FSDP do."""
    sub = mesh["dp_outer", dims.dp_shard_dim]
    return sub._unflatten(1, (dims.edp, dims.ep), ("edp", "ep"))


def expert_hsdp_mesh(expert_mesh):
    """The expert mesh's (dp_outer, edp) dims flattened: every rank holding the same experts."""
    return expert_mesh["dp_outer", "edp"]._flatten("dp_outer_edp")


def replicate_mesh(mesh, dim: str = "dp"):
    """A flat dim ("dp", or "hsdp" to include cp) as a 2-D (replicate, shard=1) mesh: FSDP2's way
    of plain replication."""
    dp = mesh[dim]
    return dp._unflatten(0, (dp.size(), 1), ("dp_replicate", "dp_single"))
