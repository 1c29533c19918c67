"""The dry run: what would run, where, and how much memory it needs. No torch, no GPU."""

from __future__ import annotations

import sys
from typing import List, Optional

from .memory import GIB, estimate, expert_share, host_line
from ..core.fp8_flops import fp8_share
from ..core.mfu import dry_run_line
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
        + (f" optim_state={cfg.optim.state_dtype}" if cfg.optim.state_dtype != "fp32" else "")
    )
    t = cfg.train
    global_batch = t.micro_batch_size * t.grad_accum_steps * dims.dp_size
    console.print(
        f"train: steps={t.steps} micro_batch={t.micro_batch_size} grad_accum={t.grad_accum_steps} "
        f"global_batch={global_batch} seq_len={t.seq_len} compile={t.compile} cuda_graph={t.cuda_graph}"
    )
    console.print(save_schedule(cfg.checkpoint, t.steps, _resume_step(cfg)), markup=False)

    table = Table(title="ranks and the groups each belongs to", box=box.SIMPLE_HEAD)
    coords = ("rank", "node", "local_rank", "dp_outer", "dp_shard", "cp", "tp", "dp_rank")
    # Every group a rank belongs to: the data-parallel ones, then context and tensor parallel.
    group_dims = (dims.dp_shard_dim, "dp_outer", "dp", "hsdp", "cp", "tp")
    for col in coords:
        table.add_column(col, justify="right")
    for col in group_dims:
        table.add_column(f"{col}\ngroup")  # two header lines: the table stays narrow
    for row in dims.rank_table(lc.nproc_per_node):
        g = dims.groups_of(row["rank"])
        table.add_row(*(str(row[c]) for c in coords), *(_short(g[k]) for k in group_dims))
    console.print(table)
    _render_experts(cfg, dims, console)

    fam = family(cfg.model.name)
    n_params = fam.param_count(cfg.model)
    console.print(fam.describe(cfg.model, cfg.train.seq_len))
    console.print(mfu_line(cfg, fam), markup=False)
    mem = estimate(cfg, dims)
    mt = Table(title=f"memory per rank (estimate; {n_params / 1e6:,.1f}M parameters)", box=box.SIMPLE_HEAD)
    mt.add_column("state")
    mt.add_column("GiB", justify="right")
    for key, value in mem.as_dict().items():
        mt.add_row(key, f"{value / GIB:.3f}")
    mt.add_row("[bold]total[/bold]", f"[bold]{mem.total / GIB:.3f}[/bold]")
    console.print(mt)
    host = host_line(cfg, dims)
    if host:
        console.print(host, markup=False)
    experts = expert_share(cfg, dims, mem)
    if experts:
        dense = mem.params + mem.main_params + mem.grads + mem.optimizer - experts
        console.print(f"of params+main_params+grads+optimizer: experts {experts / GIB:.3f} GiB, dense {dense / GIB:.3f} "
                      "GiB per rank", markup=False)
    for w in warnings:
        console.print("warning: " + w, style="yellow", markup=False)
    if not warnings:
        console.print("no warnings")


def mfu_line(cfg, fam) -> str:
    """Which peak `mfu` and `mfu_at_precision` are against, with this config's FP8 share of the FLOPs."""
    share = fp8_share(fam.matmuls(cfg.model, cfg.train.seq_len), cfg.fp8)
    return dry_run_line(cfg.train.peak_tflops, share)


def _render_experts(cfg, dims: ParallelDims, console) -> None:
    """A mixture of experts: how mesh.ep splits the experts, and each rank's ep and edp groups
    (mfsdp_launch/mesh.py)."""
    from rich import box
    from rich.table import Table

    fam = family(cfg.model.name)
    experts = fam.experts(cfg.model)
    if not experts:
        return
    console.print(f"expert mesh: mesh.ep={dims.ep} x edp={dims.edp} (of dp_shard*cp={dims.shard_size}"
                  + (f", x dp_outer={dims.dp_outer}" if dims.dp_outer > 1 else "") + f"): each rank holds "
                  f"{experts // dims.ep} of the {experts} experts of every MoE layer, sharded over its edp group; "
                  + ("tokens reach them by all-to-all over the ep group" if dims.ep > 1 else "no all-to-all"),
                  markup=False)
    if dims.ep == 1:
        return
    table = Table(title="expert groups", box=box.SIMPLE_HEAD)
    for col in ("rank", "experts", "ep group", "edp group"):
        table.add_column(col, justify="right")
    per = experts // dims.ep
    for rank in range(dims.world_size):
        g = dims.expert_groups_of(rank)
        first = g["ep"].index(rank) * per
        table.add_row(str(rank), f"{first}-{first + per - 1}", _short(g["ep"]), _short(g["edp"]))
    console.print(table)


def save_schedule(ck, steps: int, start: int = 0) -> str:
    """When the run saves: `checkpoints: every 100 steps or 30 min of training, and at the end;
    next at step 100 (keep_last=3)`. `start`: the step it resumes from."""
    when = []
    if ck.interval:
        when.append(f"every {ck.interval} steps")
    if ck.interval_minutes:
        when.append(f"{'' if when else 'every '}{ck.interval_minutes:g} min of training")
    if not when:
        if not ck.save_final:
            return "checkpoints: none (checkpoint.interval=0, interval_minutes=null, save_final=false)"
        return ("checkpoints: only at the end (step {}): a crash before it keeps nothing; set checkpoint.interval "
                "or checkpoint.interval_minutes".format(steps))
    line = "checkpoints: " + " or ".join(when) + (", and at the end" if ck.save_final else "")
    nxt = (start // ck.interval + 1) * ck.interval if ck.interval else None
    if start:
        line += f"; resuming from step {start}"
    if start >= steps:
        return line + f", train.steps={steps}: nothing left to train"
    if nxt is not None and nxt < steps:
        line += f"; next at step {nxt}"
        if ck.interval_minutes:
            line += f" (or after {ck.interval_minutes:g} min, if sooner)"
    elif ck.interval_minutes:
        line += f"; next after {ck.interval_minutes:g} min of training"
        if ck.save_final:
            line += f" (or at the end, step {steps})"
    elif ck.save_final:
        line += f"; next at the end, step {steps}"
    return line + f" (keep_last={ck.keep_last})"


def _resume_step(cfg) -> int:
    """The step a run would resume from, when its run dir is on this machine (0 otherwise)."""
    from ..core.storage import is_remote

    if is_remote(cfg.run.dir):  # an object store: a dry run does not go over the network
        return 0
    try:
        from ..checkpoint import checkpoints_dir, plan_resume

        plan = plan_resume(cfg.checkpoint, checkpoints_dir(cfg.run.dir))
    except Exception:  # noqa: BLE001 - a dry run resumes nothing; a refusal is the real run's business
        return 0
    return int(plan.step) if plan.kind == "resume" and plan.step is not None else 0


def _auto(lc) -> str:
    return f", nproc_per_node=auto: {lc.nproc_auto}" if lc.nproc_auto else ""


def _short(ranks) -> str:
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))
