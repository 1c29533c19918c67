"""The dry run: what would run, where, and how much memory it needs. No torch, no GPU."""

from __future__ import annotations

import sys
from typing import List, Optional

from .memory import GIB, estimate
from ..mesh import ParallelDims, world_size
from ..models import family


def render(cfg, warnings: List[str], console=None, dims: Optional[ParallelDims] = None) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = console or Console(highlight=False, width=None if sys.stdout.isatty() else 140)
    dims = dims or ParallelDims.from_config(cfg.mesh, world_size(cfg.launcher))
    lc = cfg.launcher
    console.print(f"[bold]mfsdp-launch dry run[/bold]: run.dir={cfg.run.dir}")
    console.print(
        f"engine={cfg.engine.name}  model={cfg.model.name}"
        + f"  data={cfg.data.name}  fp8={cfg.fp8.recipe}{' +params' if cfg.fp8.params else ''}"
    )
    console.print(
        f"mesh (dp_outer, dp_shard, cp, tp) = {dims.shape}  world={dims.world_size} "
        f"({lc.nnodes} node(s) x {lc.nproc_per_node}{_auto(lc)})  zero={cfg.sharding.zero_dp_strategy}  "
        f"outer={cfg.sharding.outer_dp_sharding_strategy}"
    )
    pc = cfg.precision
    console.print(
        f"precision: compute={pc.compute_dtype} main_params={pc.main_params_dtype} "
        f"main_grads={pc.main_grads_dtype} grad_comm={pc.grad_comm_dtype}"
    )
    t = cfg.train
    global_batch = t.micro_batch_size * t.grad_accum_steps * dims.dp_size
    console.print(
        f"train: steps={t.steps} micro_batch={t.micro_batch_size} grad_accum={t.grad_accum_steps} "
        f"global_batch={global_batch} seq_len={t.seq_len} compile={t.compile} cuda_graph={t.cuda_graph}"
    )

    table = Table(title="ranks and the groups each belongs to", box=box.SIMPLE_HEAD)
    coords = ("rank", "node", "local_rank", "dp_outer", "dp_shard", "cp", "tp", "dp_rank")
    group_dims = (dims.dp_shard_dim, "dp_outer", "dp", "hsdp", "tp")
    for col in coords:
        table.add_column(col, justify="right")
    for col in group_dims:
        table.add_column(f"{col} group")
    for row in dims.rank_table(lc.nproc_per_node):
        g = dims.groups_of(row["rank"])
        table.add_row(*(str(row[c]) for c in coords), *(_short(g[k]) for k in group_dims))
    console.print(table)

    fam = family(cfg.model.name)
    n_params = fam.param_count(cfg.model)
    console.print(fam.describe(cfg.model, cfg.train.seq_len))
    mem = estimate(cfg, dims)
    mt = Table(title=f"memory per rank (estimate; {n_params / 1e6:,.1f}M parameters)", box=box.SIMPLE_HEAD)
    mt.add_column("state")
    mt.add_column("GiB", justify="right")
    for key, value in mem.as_dict().items():
        mt.add_row(key, f"{value / GIB:.3f}")
    mt.add_row("[bold]total[/bold]", f"[bold]{mem.total / GIB:.3f}[/bold]")
    console.print(mt)
    for w in warnings:
        console.print("warning: " + w, style="yellow", markup=False)
    if not warnings:
        console.print("no warnings")


def _auto(lc) -> str:
    return f", nproc_per_node=auto: {lc.nproc_auto}" if lc.nproc_auto else ""


def _short(ranks) -> str:
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))
