"""Engine.check_step on 2 gloo ranks with real FSDP2: one all-reduce gives every rank the same
global gradient norm (also under no_shard, where the norm has no group of its own and the
replicas are weighted), the same clip (or the divisor the optimizer's step clips by) and the same verdict when only one rank's loss is not finite, even with
finite gradients; params_finite sees a non-finite weight on any rank. And set_grad_sync: ZeRO-2
holds the gathered weights across a step's micro-batches."""

from __future__ import annotations

from helpers import run_ranks


def _check_step_child(rank: int, world: int) -> None:
    for zero in ("optim_grads_params", "no_shard"):
        _check(rank, world, zero)
    print(f"rank {rank}: ok")


def _check(rank: int, world: int, zero: str) -> None:
    from types import SimpleNamespace

    import torch
    import torch.nn as nn

    from mfsdp_launch.core.schema import EngineConfig, PrecisionConfig, ShardingConfig
    from mfsdp_launch.core.sharding import ZeroStrategy
    from mfsdp_launch.engines.base import local_tensor
    from mfsdp_launch.engines.fsdp2 import FSDP2Engine
    from mfsdp_launch.mesh import ParallelDims

    dims = ParallelDims(1, world, 1, 1)
    engine = FSDP2Engine(engine_cfg=EngineConfig(), sharding_cfg=ShardingConfig(zero_dp_strategy=ZeroStrategy[zero]),
                         precision_cfg=PrecisionConfig(compute_dtype="fp32"), dims=dims, mesh=dims.build("cpu"),
                         device=torch.device("cpu"))
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 5))  # 5 rows: uneven shards

    ref = make()
    model = engine.shard(make(), SimpleNamespace(unit_modules=(nn.Linear,)), init_on_meta=False)
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    loss = model(xs[rank]).pow(2).mean()
    loss.backward()
    # The reference: the mean of both ranks' losses on the unsharded model, and its gradient norm.
    ref_losses = [ref(x).pow(2).mean() for x in xs]
    (sum(ref_losses) / world).backward()
    want = torch.sqrt(sum(q.grad.pow(2).sum() for q in ref.parameters())).item()

    ok = engine.check_step(model, None, loss.detach())
    assert ok.finite and ok.bad_ranks == 0, ok
    assert abs(ok.grad_norm - want) < 1e-5 * want and abs(ok.loss - sum(ref_losses).item() / world) < 1e-5, (ok, want)
    # Rank 1's loss alone is NaN, the gradients are finite: both ranks see a bad step, same norm.
    bad = engine.check_step(model, None, loss.detach() * (float("nan") if rank == 1 else 1.0))
    assert not bad.finite and bad.bad_ranks == 1 and abs(bad.grad_norm - want) < 1e-5 * want, bad
    # Clipping (a finite step) scales every shard to the same global norm.
    engine.check_step(model, 0.5 * want, loss.detach())
    assert abs(engine.check_step(model, None, loss.detach()).grad_norm - 0.5 * want) < 1e-4 * want
    # Clipping in the optimizer's step: the gradients stay as they are, the check says what to
    # divide them by (host and deferred checks alike); none without a clip, never below 1.
    grads = [local_tensor(p.grad).clone() for p in model.parameters()]
    for defer in (False, True):
        folded = engine.check_step(model, 0.25 * want, loss.detach(), defer=defer, clip_in_step=True)
        assert abs(folded.clip_divisor.item() - 2.0) < 1e-4, folded.clip_divisor
        assert engine.check_step(model, 4 * want, loss.detach(), defer=defer, clip_in_step=True).clip_divisor == 1.0
        assert engine.check_step(model, None, loss.detach(), defer=defer, clip_in_step=True).clip_divisor is None
    assert all(torch.equal(g, local_tensor(p.grad)) for g, p in zip(grads, model.parameters()))

    assert engine.params_finite(model)
    if rank == 1:
        with torch.no_grad():
            local_tensor(next(iter(model.parameters()))).view(-1)[0] = float("inf")
    assert not engine.params_finite(model)


def test_check_step_is_global_and_alike_on_every_rank():
    outs = run_ranks(_check_step_child, 2)
    assert all(f"rank {r}: ok" in out for r, out in enumerate(outs)), outs


def _held_child(rank: int, world: int) -> None:
    """Between a step's micro-batches ZeRO-2 keeps the weights gathered (plain tensors) and
    ZeRO-3 reshards them (DTensors); after the step's last micro-batch both are sharded, and the
    accumulated gradients are those of the whole step."""
    from types import SimpleNamespace

    import torch
    import torch.nn as nn
    from torch.distributed.tensor import DTensor

    from mfsdp_launch.core.schema import EngineConfig, PrecisionConfig, ShardingConfig
    from mfsdp_launch.core.sharding import ZeroStrategy
    from mfsdp_launch.engines.fsdp2 import FSDP2Engine
    from mfsdp_launch.mesh import ParallelDims

    dims = ParallelDims(1, world, 1, 1)
    xs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + m)) for m in range(3)]
    grads = {}
    for zero in ("optim_grads", "optim_grads_params"):
        engine = FSDP2Engine(engine_cfg=EngineConfig(), sharding_cfg=ShardingConfig(zero_dp_strategy=ZeroStrategy[zero]),
                             precision_cfg=PrecisionConfig(compute_dtype="fp32"), dims=dims, mesh=dims.build("cpu"),
                             device=torch.device("cpu"))
        torch.manual_seed(0)
        model = engine.shard(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
                             SimpleNamespace(unit_modules=(nn.Linear,)), init_on_meta=False)
        held = []
        for micro, x in enumerate(xs):
            engine.set_grad_sync(model, micro == len(xs) - 1)
            model(x).pow(2).mean().backward()
            held.append(not isinstance(model[0].weight, DTensor))
        assert held == ([True, True, False] if zero == "optim_grads" else [False, False, False]), (zero, held)
        grads[zero] = [p.grad.full_tensor() for p in model.parameters()]
    assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(*grads.values()))
    print(f"rank {rank}: ok")


def test_zero2_holds_the_gathered_weights_across_micro_batches():
    outs = run_ranks(_held_child, 2)
    assert all(f"rank {r}: ok" in out for r, out in enumerate(outs)), outs
