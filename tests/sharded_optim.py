"""An optimizer on real FSDP2 (gloo ranks) and DCP, for the optimizer tests
(tests/unit/components/test_muon_dist.py, test_adamw_state_dtype.py): the tiny gpt, each rank's
rows of a step's global batch, the sharded model, one training step and a checkpoint manager."""

from __future__ import annotations

from pathlib import Path

from helpers import model_cfg


def tiny_gpt():
    import torch

    from mfsdp_launch.models.llama.dims import resolve_gpt_dims
    from mfsdp_launch.models.llama.gpt_modules import GPT

    torch.manual_seed(0)
    return GPT(resolve_gpt_dims(model_cfg("gpt", preset="tiny")))


def batch(step: int, rank: int, world: int, rows: int = 4, seq: int = 16) -> dict:
    """Rank `rank`'s rows of step `step`'s global batch (world 1: all of it)."""
    import torch

    g = torch.Generator().manual_seed(step)
    w = torch.randint(0, 256, (rows, seq + 1), generator=g)
    part = slice(rank * rows // world, (rank + 1) * rows // world)
    return {"input_ids": w[part, :-1], "labels": w[part, 1:]}


def sharded_gpt(world: int):
    """(engine, model): the tiny gpt under FSDP2 over `world` gloo ranks, its Blocks the units."""
    from types import SimpleNamespace

    import torch

    from mfsdp_launch.core.schema import EngineConfig, PrecisionConfig, ShardingConfig
    from mfsdp_launch.engines.fsdp2 import FSDP2Engine
    from mfsdp_launch.mesh import ParallelDims
    from mfsdp_launch.models.llama.gpt_modules import Block

    dims = ParallelDims(1, world, 1, 1)
    engine = FSDP2Engine(engine_cfg=EngineConfig(), sharding_cfg=ShardingConfig(), precision_cfg=PrecisionConfig(),
                         dims=dims, mesh=dims.build("cpu"), device=torch.device("cpu"))
    return engine, engine.shard(tiny_gpt(), SimpleNamespace(unit_modules=(Block,)), init_on_meta=False)


def train_step(model, opt, sched, step: int, rank: int, world: int, grads_to=None) -> None:
    """One step; `grads_to` (a plain model) gets a copy of the whole gradients first."""
    from torch.distributed.tensor import DTensor

    from mfsdp_launch.models.losses import lm_loss

    lm_loss(model, batch(step, rank, world)).backward()
    if grads_to is not None:
        params = dict(grads_to.named_parameters())
        for name, p in model.named_parameters():
            params[name].grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad.clone()
    opt.step()
    sched.step()
    opt.zero_grad()


def checkpoint_manager(run: Path, world: int, rank: int, engine, *, interval: int, tag: str):
    import torch.distributed as dist

    from mfsdp_launch.checkpoint import CheckpointManager
    from mfsdp_launch.core.schema import CheckpointConfig

    info = {"config_hash": tag, "model": {"name": "gpt"}, "mesh": {"dp_shard": world, "world_size": world},
            "engine": {"name": "fsdp2"}, "versions": {}, "seed": 0}
    return CheckpointManager(CheckpointConfig(interval=interval), run, manifest_info=info, rank=rank,
                             world_size=world, engine=engine, process_group=dist.new_group(backend="gloo"))
