"""Expert parallelism on 4 gloo ranks under FSDP2, in one group of processes: mesh.ep=2 trains the
same 20 losses and gradient norms as the unsharded model does in this process, each rank's batch
one micro-batch of a step (what mesh.ep=1 computes; fp32, to 1e-5; sigmoid routing with its
balancing bias, a capacity, a shared expert and both balancing losses), each rank holds
experts/ep experts (its local shapes),
and Megatron-FSDP's expert mesh for ep > 1 (engines/megatron_experts.py) has the groups
mfsdp_launch/mesh.py promises. The 2-rank ep=2 == ep=1 case and the checkpoint at ep=2 resumed at
ep=1 are the CLI's (tests/e2e/test_moe_e2e.py)."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import run_ranks

STEPS = 20
MOE = dict(router="sigmoid", bias_update_rate=0.01, capacity_factor=1.0, shared_experts=1, aux_loss_coef=0.01,
           z_loss_coef=0.001)


SEQ = 16


def _config():
    from mfsdp_launch.models import family
    from mfsdp_launch.models.llama.config import GPTModelConfig, MoEConfig

    m = GPTModelConfig(preset="tiny_moe", n_layers=1, moe=MoEConfig(**MOE))
    return family("gpt"), m, family("gpt").spec(m, SEQ)


def _batch(step: int, dp_rank: int) -> dict:
    import torch

    ids = torch.randint(0, 256, (2, SEQ + 1), generator=torch.Generator().manual_seed(step * 100 + dp_rank))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def _reference(world: int, steps: int = STEPS):
    """One process, no sharding: each step's `world` batches as micro-batches (what data
    parallelism averages), clipped at 1.0 as the engine clips."""
    import torch

    _, _, spec = _config()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: one thread each (the machine's cores are theirs)
    torch.manual_seed(0)
    model = spec.build()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    out = []
    for step in range(steps):
        loss = 0.0
        for dp_rank in range(world):
            micro = spec.loss(model, _batch(step, dp_rank)) / world
            micro.backward()
            loss += micro.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        opt.step()
        opt.zero_grad()
        spec.after_step(model, True)
        out.append((loss, norm))
    torch.set_num_threads(threads)
    return out


def _train(dims, steps: int = STEPS):
    import torch
    import torch.distributed as dist

    from mfsdp_launch.core.schema import PrecisionConfig, ShardingConfig
    from mfsdp_launch.engines.config import FSDP2Config
    from mfsdp_launch.engines.fsdp2 import FSDP2Engine

    fam, m, spec = _config()
    mesh = dims.build("cpu")
    torch.manual_seed(0)
    model = spec.build()
    fam.parallelize(model, m, dims, mesh)
    engine = FSDP2Engine(engine_cfg=FSDP2Config(), sharding_cfg=ShardingConfig(), precision_cfg=PrecisionConfig(),
                         dims=dims, mesh=mesh, device=torch.device("cpu"))
    model = engine.shard(model, spec, init_on_meta=False)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dp_rank = dims.dp_rank(dist.get_rank())
    losses = []
    for step in range(steps):
        loss = spec.loss(model, _batch(step, dp_rank))
        loss.backward()
        check = engine.check_step(model, 1.0, loss.detach())
        opt.step()
        opt.zero_grad()
        spec.after_step(model, True)
        losses.append((check.loss, check.grad_norm))  # the norm sees a mis-scaled expert gradient
    return losses, model


def _expert_mesh_groups(dims) -> dict:
    import torch.distributed as dist

    from mfsdp_launch.engines.megatron_experts import expert_mesh_kwargs

    kw = expert_mesh_kwargs(dims.build("cpu"), dims, "dp_shard", "dp_outer" if dims.dp_outer > 1 else None, "tp")
    mesh = kw["expt_device_mesh"]
    out = {"shard": dist.get_process_group_ranks(mesh["dp_shard"].get_group())}
    if "hybrid_fsdp_expt_group" in kw:
        out["hybrid"] = dist.get_process_group_ranks(kw["hybrid_fsdp_expt_group"])
    return out


def _ranks_ep(rank, world, out):
    import torch
    from torch.distributed.tensor import Replicate, Shard

    from mfsdp_launch.mesh import ParallelDims

    torch.set_num_threads(1)
    two, model = _train(ParallelDims(1, world, 1, 1, ep=2))
    w = model.layers[0].mlp.experts.w_gate_up
    # gathered over its edp group (as FSDP does for forward): this rank's ep share
    unsharded = w.redistribute(w.device_mesh, [Replicate(), Shard(0)]).to_local()
    result = {"ep2": two, "global": list(w.shape), "local": list(w.to_local().shape),
              "ep_local": list(unsharded.shape), "dims": list(w.device_mesh.mesh_dim_names),
              "megatron": _expert_mesh_groups(ParallelDims(1, world, 1, 1, ep=2)),
              "megatron_hsdp": _expert_mesh_groups(ParallelDims(2, world // 2, 1, 1, ep=2))}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


def test_ep2_on_four_ranks_trains_as_one_process(tmp_path):
    run_ranks(_ranks_ep, 4, str(tmp_path), timeout=300)
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    one, two = _reference(4), rows[0]["ep2"]
    assert len(one) == STEPS and one[-1][0] < one[0][0]
    assert max(abs(a - b) / abs(a) for x, y in zip(one, two) for a, b in zip(x, y)) < 1e-5
    for r, row in enumerate(rows):
        # 4 experts of [2*96, 64]: 2 per ep rank, 1 after FSDP over its edp pair
        assert row["global"] == [4, 192, 64] and row["ep_local"] == [2, 192, 64] and row["local"] == [1, 192, 64]
        assert row["dims"] == ["edp", "ep"]
        assert row["megatron"] == {"shard": [r % 2, r % 2 + 2]}  # the ranks at its ep slot
        # HSDP 2 x 2, ep=2: edp is the rank alone inside its replica; with dp_outer both replicas' slot
        assert row["megatron_hsdp"] == {"shard": [r], "hybrid": [r % 2, r % 2 + 2]}
