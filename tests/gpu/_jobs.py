"""Case functions run inside GPU test jobs (see _harness.py). Each returns JSON-able data that
the pytest side asserts on; collectives are kept in the same order on every rank.

They drive the launcher's own wiring (mfsdp_launch/rank/runtime.py: build_model, build_engine, the
optimizer) on typed configs, then the engine's verbs (shard / wrap_optimizer / set_grad_sync / clip_grad_norm /
state_dict / load_state_dict), precision's FP8 recipes and cuda_graph.FullIterationCudaGraph.
The scenarios and their assertions are the seed test's (Megatron-FSDP test_fully_shard.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from omegaconf import OmegaConf

from mfsdp_launch.components import precision as P
from mfsdp_launch.planner.compose import typed_schema
from mfsdp_launch.engines.base import local_tensor, strip_prefixes
from mfsdp_launch.engines.megatron_grad_scaling import grad_buffers
from mfsdp_launch.mesh import ParallelDims
from mfsdp_launch.components.optim import build_optimizer
from mfsdp_launch.rank.runtime import Runtime, build_engine, build_model

NUM_STEPS = 2  # the seed's NUM_STEPS


class Skip(Exception):
    pass


class Context:
    def __init__(self, mesh_shape, *, rank: int, world: int, device, tmpdir: str):
        self.rank, self.world, self.device = rank, world, device
        self.tmpdir = Path(tmpdir)
        if mesh_shape is not None:
            self.dims = ParallelDims(*mesh_shape)
            self.mesh = self.dims.build(device.type)
        else:
            self.dims = ParallelDims(1, world, 1, 1)
            self.mesh = None
        self.gloo = dist.new_group(backend="gloo")

    def barrier(self, timeout: float = 600) -> None:
        from datetime import timedelta

        dist.monitored_barrier(group=self.gloo, timeout=timedelta(seconds=timeout))

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------- helpers

TOY = {
    "toy_cnn": dict(name="toy_cnn", dim=2, n_layers=2),
    "toy_transformer": dict(name="toy_transformer", dim=2, n_layers=2, n_heads=2),
    # The seed's TE_TRANSFORMER in test_fully_shard / dcp: model_dim=DIM_SIZE=2, 2 heads, fp32.
    "te_toy_transformer": dict(name="te_toy_transformer", dim=2, n_layers=2, n_heads=2),
    # The seed's quantized / custom-dtype TE model: dim 64, fused QKV, bf16 params.
    "te_toy_fp8": dict(name="te_toy_transformer", dim=64, n_layers=2, n_heads=2, fuse_qkv=True, params_dtype="bf16"),
    "gpt_tiny": dict(name="gpt", preset="tiny"),
}


def typed(**sections):
    """A typed config (enum names or numbers accepted), as composition would give it."""
    return OmegaConf.merge(typed_schema(sections), sections)


def model_cfg(model: str):
    return typed(model=TOY[model]).model


def spec_of(model: str, seq_len: int = 32):
    from mfsdp_launch.models import build_model_spec

    return build_model_spec(model_cfg(model), seq_len)


def build(ctx: Context, model: str, *, meta: bool, seed: int = 0, fp8_recipe=None, freeze=()):
    """(model, frozen names) through the worker's runtime.build_model."""
    torch.manual_seed(seed)
    cfg = typed(model=dict(TOY[model], init_on_meta=meta, freeze=list(freeze)),
                fp8=dict(params=fp8_recipe is not None))
    _, m, frozen, _ = build_model(cfg.model, cfg.fp8, 32, ctx.device, fp8_recipe)
    return m, frozen


def engine_for(ctx: Context, *, zero, outer="no_shard", compute="fp32", main_params="fp32", main_grads=None,
               grad_comm=None, use_mesh: bool = True, cuda_graph: bool = False, **engine_kw):
    """The engine the worker builds (runtime.build_engine) for these settings."""
    cfg = typed(engine=dict(name="megatron_fsdp", **engine_kw),
                sharding=dict(zero_dp_strategy=zero, outer_dp_sharding_strategy=outer),
                precision=dict(compute_dtype=compute, main_params_dtype=main_params, main_grads_dtype=main_grads,
                               grad_comm_dtype=grad_comm),
                train=dict(cuda_graph="full_iteration" if cuda_graph else "none"))
    rt = Runtime(rank=ctx.rank, local_rank=ctx.rank, world_size=ctx.world, device=ctx.device, control=ctx.gloo,
                 dims=ctx.dims, mesh=ctx.mesh if use_mesh else None)
    return build_engine(cfg, rt)


def optimizer_for(engine, model, *, lr=0.01, weight_decay=0.0, impl="torch"):
    cfg = typed(optim=dict(impl=impl, lr=lr, weight_decay=weight_decay)).optim
    return engine.wrap_optimizer(model, build_optimizer(model, cfg, fused_ok=True))


def toy_batch(spec, ctx: Context, mbs: int = 1, seed: int = 1234):
    return spec.synthetic_batch(torch.Generator().manual_seed(seed), mbs, ctx.device)


def token_batch(ctx: Context, vocab: int = 256, batch: int = 2, seq: int = 32, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return {"input_ids": ids[:, :-1].to(ctx.device), "labels": ids[:, 1:].to(ctx.device)}


def any_over(flag: bool, group) -> bool:
    """any() of a Python bool over a process group (the seed's all_gather_object)."""
    if group is None or dist.get_world_size(group) == 1:
        return bool(flag)
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, bool(flag), group=group)
    return any(out)


def grads_nonzero(model, attrs=("grad",)) -> bool:
    for p in model.parameters():
        for a in attrs:
            g = getattr(p, a, None)
            if isinstance(g, torch.Tensor) and local_tensor(g).count_nonzero().item() > 0:
                return True
    return False


def local_clone(v):
    if isinstance(v, torch.Tensor):
        return local_tensor(v).detach().clone()
    return v


def snapshot(state: dict) -> dict:
    model = {k: local_clone(v) for k, v in state["model"].items() if isinstance(v, torch.Tensor)}
    optim = {}
    if "optimizer" in state:
        for idx, st in state["optimizer"]["state"].items():
            optim[idx] = {k: local_clone(v) for k, v in st.items()}
    groups = [{k: v for k, v in g.items()} for g in state["optimizer"]["param_groups"]] if "optimizer" in state else []
    return {"model": model, "optim": optim, "groups": groups}


def compare(a: dict, b: dict) -> dict:
    """The seed's state-dict comparisons (values identical, shapes equal, keys present)."""
    problems: List[str] = []
    n_model = n_optim = 0
    for key in sorted(set(a["model"]) | set(b["model"])):
        v1, v2 = a["model"].get(key), b["model"].get(key)
        if v1 is None or v2 is None:
            problems.append(f"model {key}: missing ({v1 is None}, {v2 is None})")
        elif v1.shape != v2.shape:
            problems.append(f"model {key}: shape {tuple(v1.shape)} != {tuple(v2.shape)}")
        elif not torch.equal(v1, v2):
            problems.append(f"model {key}: max diff {(v1.float() - v2.float()).abs().max().item():.3g}")
        elif v1.numel():
            n_model += 1
    for idx in sorted(set(a["optim"]) | set(b["optim"]), key=str):
        s1, s2 = a["optim"].get(idx), b["optim"].get(idx)
        if s1 is None or s2 is None:
            problems.append(f"optim {idx}: missing")
            continue
        for key in sorted(set(s1) | set(s2)):
            v1, v2 = s1.get(key), s2.get(key)
            if v1 is None or v2 is None:
                problems.append(f"optim {idx}.{key}: missing")
            elif isinstance(v1, torch.Tensor):
                if v1.shape != v2.shape:
                    problems.append(f"optim {idx}.{key}: shape {tuple(v1.shape)} != {tuple(v2.shape)}")
                elif not torch.equal(v1.float(), v2.float()):
                    problems.append(f"optim {idx}.{key}: max diff {(v1.float() - v2.float()).abs().max().item():.3g}")
                elif v1.numel():
                    n_optim += 1
            elif v1 != v2:
                problems.append(f"optim {idx}.{key}: {v1} != {v2}")
    if len(a["groups"]) != len(b["groups"]):
        problems.append(f"param_groups: {len(a['groups'])} != {len(b['groups'])}")
    else:
        for i, (g1, g2) in enumerate(zip(a["groups"], b["groups"])):
            for k in g1:
                x, y = g1[k], g2.get(k)
                if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
                    same = torch.is_tensor(x) and torch.is_tensor(y) and torch.equal(x.cpu(), y.cpu())
                else:
                    same = x == y
                if not same:
                    problems.append(f"param_groups[{i}].{k}: {x} != {y}")
    return {"problems": problems[:20], "n_problems": len(problems), "n_model": n_model, "n_optim": n_optim}


def optim_checksums(opt) -> Dict[str, List[float]]:
    """Per optimizer-state tensor: [sum of squares, sum of |x|] over the whole (unsharded) tensor.

    Collective over the world. The key set differs between ranks: the optimizer keeps no state
    for a parameter whose local shard is empty (uneven shards), and Megatron-FSDP 0.6.1 mocks
    the missing DTensors only in a private copy inside its state_dict post-hook
    (fully_shard.py `optim_state_extended`), not in the dict `state_dict()` returns. So the keys
    and their sharded-ness are all-gathered first, every rank contributes zeros for a sharded
    key it lacks, and one SUM all-reduce over the union (same order everywhere) adds the shard
    sums. A replicated tensor's sums are contributed by the lowest rank that holds it.
    (Gathering the full uneven tensors with megatron_fsdp.uneven_dtensor_to_full_tensor failed
    on the optimizer state on 2xH200: "expanded size 64 must match 256".)
    """
    from torch.distributed.tensor import DTensor, Shard

    osd = opt.state_dict()
    local: Dict[str, torch.Tensor] = {}
    sharded: Dict[str, bool] = {}
    for idx in sorted(osd["state"]):
        st = osd["state"][idx]
        for key in sorted(st):
            v = st[key]
            if key == "step" or not isinstance(v, torch.Tensor):
                continue
            lt = local_tensor(v).detach().double()
            name = f"{idx}.{key}"
            local[name] = torch.stack([lt.pow(2).sum(), lt.abs().sum()]) if lt.numel() else \
                torch.zeros(2, dtype=torch.float64, device=lt.device)
            sharded[name] = isinstance(v, DTensor) and any(isinstance(p, Shard) for p in v.placements)
    world = dist.get_world_size()
    if world == 1:
        return {k: t.tolist() for k, t in local.items()}
    every: List[Optional[Dict[str, bool]]] = [None] * world
    dist.all_gather_object(every, sharded)
    names = sorted({k for d in every for k in d}, key=lambda k: (int(k.split(".", 1)[0]), k))
    rank = dist.get_rank()
    device = next(iter(local.values())).device if local else local_tensor(opt.param_groups[0]["params"][0]).device
    rows = []
    for k in names:
        is_sharded = any(d.get(k, False) for d in every)
        owner = min(r for r, d in enumerate(every) if k in d)
        mine = k in local and (is_sharded or rank == owner)
        rows.append(local[k] if mine else torch.zeros(2, dtype=torch.float64, device=device))
    sums = torch.stack(rows) if rows else torch.zeros(0, 2, dtype=torch.float64, device=device)
    dist.all_reduce(sums)
    return {k: sums[i].tolist() for i, k in enumerate(names)}


def train_step(engine, model, opt, spec, batch, *, ctx=None, fp8_recipe=None, clip=None) -> float:
    engine.set_grad_sync(model, True)
    with P.fp8_autocast(fp8_recipe):
        loss = spec.loss(model, batch)
    loss.backward()
    if clip is not None:
        engine.clip_grad_norm(model, clip)
    opt.step()
    opt.zero_grad()
    return loss.item()


def sharding_group(ctx: Context, outer: str):
    """The seed's group for the grads-exist check."""
    if ctx.mesh is None:
        return dist.group.WORLD
    if outer == "optim":
        return ctx.mesh["hsdp"].get_group()
    return ctx.mesh[ctx.dims.dp_shard_dim].get_group()


# ------------------------------------------------------------------------------------- cases


def selftest(ctx: Context, fail: bool = False, skip: bool = False):
    """Harness plumbing check (runs on CPU/gloo too)."""
    if skip:
        raise Skip("asked to skip")
    if fail and ctx.rank == 1:
        raise ValueError("asked to fail on rank 1")
    got = any_over(ctx.rank == 1, dist.group.WORLD)
    return {"rank": ctx.rank, "any": got, "mesh": list(ctx.dims.shape), "t": torch.ones(2)}


def fully_shard(ctx: Context, model: str, zero: str, outer: str, preserve_fp32: bool, meta: bool,
                compile: bool):
    """Seed test_fully_shard: sync only on the last microbatch; no grads before it, grads after."""
    spec = spec_of(model)
    m, _ = build(ctx, model, meta=meta)
    eng = engine_for(ctx, zero=zero, outer=outer, main_params="fp32" if preserve_fp32 else None,
                     report_nan_in_param_grad=True)
    m = eng.shard(m, spec, init_on_meta=meta)
    fwd = torch.compile(m) if compile else m
    opt = optimizer_for(eng, m)
    batch = toy_batch(spec, ctx)
    grads_exist, losses = [], []
    group = sharding_group(ctx, outer)
    for step in range(NUM_STEPS):
        eng.set_grad_sync(fwd, step == NUM_STEPS - 1)
        loss = spec.loss(fwd, batch)
        loss.backward()
        local = grads_nonzero(m)
        exist = any_over(local, group) if zero != "no_shard" else local
        grads_exist.append(exist)
        losses.append(loss.item())
        dist.barrier()
        if step == NUM_STEPS - 1:
            opt.step()
            opt.zero_grad()
    with torch.no_grad():
        after = spec.loss(fwd, batch).item()
    return {"grads_exist": grads_exist, "losses": losses + [after]}


def dcp_roundtrip(ctx: Context, model: str, zero: str, outer: str):
    """Seed test_dcp_checkpoint_save_and_load (+ no_shard, which upstream xfails), through the
    engine: train a step, save, load into a model built from another seed, compare."""
    import torch.distributed.checkpoint as dcp

    spec = spec_of(model)
    batch = toy_batch(spec, ctx)

    def make(seed):
        m, _ = build(ctx, model, meta=False, seed=seed)
        e = engine_for(ctx, zero=zero, outer=outer, main_params="fp32", main_grads="fp32")
        m = e.shard(m, spec, init_on_meta=False)
        return e, m, optimizer_for(e, m)

    e1, m1, o1 = make(0)
    train_step(e1, m1, o1, spec, batch)
    m1.eval()
    with torch.no_grad():
        pre = spec.loss(m1, batch).item()
    s1 = snapshot(e1.state_dict(m1, o1))
    ckpt = ctx.tmpdir / f"dcp_{model}_{zero}_{outer}"
    dcp.save(e1.state_dict(m1, o1), checkpoint_id=str(ckpt))

    e2, m2, o2 = make(1)
    differs_before = compare(s1, snapshot(e2.state_dict(m2, o2)))["n_problems"] > 0
    state = e2.state_dict(m2, o2)
    dcp.load(state, checkpoint_id=str(ckpt))
    e2.load_state_dict(m2, o2, state)
    cmp = compare(s1, snapshot(e2.state_dict(m2, o2)))
    m2.eval()
    with torch.no_grad():
        post = spec.loss(m2, batch).item()
    # Training continues, identically on both.
    after = []
    for e, m, o in ((e1, m1, o1), (e2, m2, o2)):
        train_step(e, m, o, spec, batch)
        with torch.no_grad():
            after.append(spec.loss(m, batch).item())
    return {"pre": pre, "post": post, "after": after, "differs_before": differs_before, **cmp}


def adamw_equivalence(ctx: Context, zero: str, outer: str = "no_shard", clip: Optional[float] = 0.05,
                      steps: int = 3, main_grads: str = "fp32"):
    """First updates equal plain torch.optim.AdamW on the same model and data (the 0.6.1 synthetic
    step workaround), and the engine's clipped global norm equals clip_grad_norm_'s. `scaling`:
    the gradient buffers' factors (engines/megatron.py drops 1.0)."""
    spec = spec_of("gpt_tiny")
    batch = token_batch(ctx)
    ref, _ = build(ctx, "gpt_tiny", meta=False, seed=0)
    m, _ = build(ctx, "gpt_tiny", meta=False, seed=0)
    eng = engine_for(ctx, zero=zero, outer=outer, main_params="fp32", main_grads=main_grads)
    m = eng.shard(m, spec, init_on_meta=False)
    scaling = sorted({repr(gbuf.gradient_scaling_factor) for gbuf in grad_buffers(m)})
    ocfg = typed(optim=dict(lr=1e-3, weight_decay=0.1)).optim
    opt = eng.wrap_optimizer(m, build_optimizer(m, ocfg, fused_ok=True))
    ropt = build_optimizer(ref, ocfg, fused_ok=True)
    diffs, norms, rnorms, losses, rlosses = [], [], [], [], []
    for _ in range(steps):
        eng.set_grad_sync(m, True)
        loss = spec.loss(m, batch)
        loss.backward()
        norm = eng.clip_grad_norm(m, clip)
        rloss = spec.loss(ref, batch)
        rloss.backward()
        rparams = [p for p in ref.parameters() if p.grad is not None]
        rnorm = torch.nn.utils.clip_grad_norm_(rparams, clip if clip is not None else float("inf"))
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
        full = eng.full_model_state_dict(m)
        rsd = {k: v.detach().cpu() for k, v in ref.state_dict().items()}
        diffs.append(max((full[k].float() - rsd[k].float()).abs().max().item() for k in rsd))
        norms.append(norm.item())
        rnorms.append(rnorm.item())
        losses.append(loss.item())
        rlosses.append(rloss.item())
    return {"max_param_diff": diffs, "norm": norms, "ref_norm": rnorms, "loss": losses, "ref_loss": rlosses,
            "clip": clip, "n_state": len(opt.state), "n_opt_params": sum(len(g["params"]) for g in opt.param_groups),
            "scaling": scaling}


def frozen(ctx: Context, meta: bool, zero: str = "optim_grads"):
    """Seed test_model_with_frozen_param, with model.freeze globs (Megatron-FSDP's own mesh)."""
    spec = spec_of("toy_transformer")
    m, frozen_names = build(ctx, "toy_transformer", meta=meta, freeze=["transformer.encoder.*"])
    n_params = len(list(m.parameters()))
    eng = engine_for(ctx, zero=zero, use_mesh=False)
    m = eng.shard(m, spec, init_on_meta=meta)
    names = {strip_prefixes(n): p for n, p in m.named_parameters()}
    still_frozen = all(not names[n].requires_grad for n in frozen_names)
    trainable = sum(1 for p in names.values() if p.requires_grad)
    before = {n: local_clone(names[n]) for n in frozen_names}
    opt = optimizer_for(eng, m)
    batch = toy_batch(spec, ctx)
    losses = [train_step(eng, m, opt, spec, batch) for _ in range(NUM_STEPS)]
    names = {strip_prefixes(n): p for n, p in m.named_parameters()}
    unchanged = all(torch.equal(before[n], local_tensor(names[n]).detach()) for n in frozen_names)
    # Optimizer state exists for trainable parameters only (an empty local shard has none).
    state_for_frozen = any(names[n] in opt.state for n in frozen_names)
    return {"n_frozen": len(frozen_names), "n_params": n_params, "n_params_after": len(names),
            "still_frozen": still_frozen, "unchanged": unchanged, "state_for_frozen": state_for_frozen,
            "n_opt_params": sum(len(g["params"]) for g in opt.param_groups), "trainable": trainable,
            "losses": losses}


def ez(ctx: Context, zero: str):
    """Seed test_fully_shard_ez: no DeviceMesh (mesh.enabled=false)."""
    spec = spec_of("toy_transformer")
    m, _ = build(ctx, "toy_transformer", meta=False)
    eng = engine_for(ctx, zero=zero, use_mesh=False)
    m = eng.shard(m, spec, init_on_meta=False)
    opt = optimizer_for(eng, m)
    batch = toy_batch(spec, ctx)
    losses = [train_step(eng, m, opt, spec, batch) for _ in range(NUM_STEPS)]
    return {"losses": losses}


def custom_dtype(ctx: Context, model: str, zero: str, outer: str, main_params: Optional[str],
                 main_grads: Optional[str]):
    """Seed test_fully_shard_custom_dtype: buffer dtypes follow the policy; grad_comm_dtype
    changes per step through mixed_precision_context."""
    from megatron_fsdp import MixedPrecisionPolicy

    te_model = model == "te_toy_fp8"
    if te_model and main_params is None:
        raise Skip("TransformerEngine FP8 all-gather requires a main parameter buffer for FSDP.")
    recipe = P.build_fp8_recipe(typed(fp8=dict(recipe="delayed")).fp8) if te_model else None
    spec = spec_of(model)
    m, _ = build(ctx, model, meta=True, fp8_recipe=recipe)
    eng = engine_for(ctx, zero=zero, outer=outer, compute="bf16" if te_model else "fp32",
                     main_params=main_params, main_grads=main_grads, report_nan_in_param_grad=True,
                     keep_fp8_transpose_cache=te_model)
    m = eng.shard(m, spec, init_on_meta=True)
    group0 = m.param_and_grad_buffer.parameter_groups[0]
    mwb = getattr(group0, "main_weight_buffer", None)
    mgb = getattr(group0, "main_grad_buffer", None)
    opt = optimizer_for(eng, m, lr=0.001)
    batch = toy_batch(spec, ctx, mbs=16 if te_model else 1)
    losses = []
    for comm in (None, torch.float16):
        with m.mixed_precision_context(MixedPrecisionPolicy(grad_comm_dtype=comm)):
            losses.append(train_step(eng, m, opt, spec, batch, fp8_recipe=recipe))
    return {"main_weight_dtype": str(mwb.data.dtype) if mwb is not None else None,
            "main_grad_dtype": str(mgb.data.dtype) if mgb is not None else None,
            "expected_main_params": str(P.torch_dtype(main_params)) if main_params else None,
            "expected_main_grads": str(P.torch_dtype(main_grads)) if main_grads else None,
            "losses": losses}


def _resume_model(ctx: Context, zero: str, seed: int):
    """The sharded tiny GPT and its optimizer that the resume cases save and load."""
    spec = spec_of("gpt_tiny")
    m, _ = build(ctx, "gpt_tiny", meta=False, seed=seed)
    eng = engine_for(ctx, zero=zero, main_params="fp32", main_grads="fp32")
    m = eng.shard(m, spec, init_on_meta=False)
    opt = optimizer_for(eng, m, lr=1e-3, weight_decay=0.1)
    return spec, token_batch(ctx), eng, m, opt


def resume_save(ctx: Context, zero: str, steps_before: int = 2, steps_after: int = 2):
    """Train, checkpoint through the engine + DCP, record the unsharded state and the losses of
    the steps that follow (every rank sees the same batch, so one rank must reproduce them)."""
    import torch.distributed.checkpoint as dcp

    spec, batch, eng, m, opt = _resume_model(ctx, zero, seed=0)
    for _ in range(steps_before):
        train_step(eng, m, opt, spec, batch, clip=1.0)
    base = Path(ctx.tmpdir).parent.parent / "shared_resume"
    ckpt = base / f"ckpt_{zero}"
    dcp.save(eng.state_dict(m, opt), checkpoint_id=str(ckpt))
    full = eng.full_model_state_dict(m)
    fopt = optim_checksums(opt)
    losses = [train_step(eng, m, opt, spec, batch, clip=1.0) for _ in range(steps_after)]
    if ctx.rank == 0:
        torch.save({"model": full, "optim": fopt, "losses": losses}, base / f"ref_{zero}.pt")
    dist.barrier()
    return {"losses": losses, "ckpt": str(ckpt)}


def resume_load(ctx: Context, zero: str, saved_zero: Optional[str] = None, steps_after: int = 2):
    """Load a checkpoint written at another world size (and maybe another strategy) into a model
    built from another seed; compare the unsharded state; continue training."""
    import torch.distributed.checkpoint as dcp

    saved_zero = saved_zero or zero
    base = Path(ctx.tmpdir).parent.parent / "shared_resume"
    ref = torch.load(base / f"ref_{saved_zero}.pt", weights_only=False)
    spec, batch, eng, m, opt = _resume_model(ctx, zero, seed=1)
    state = eng.state_dict(m, opt)
    dcp.load(state, checkpoint_id=str(base / f"ckpt_{saved_zero}"))
    eng.load_state_dict(m, opt, state)
    full = eng.full_model_state_dict(m)
    fopt = optim_checksums(opt)
    model_diff = max((full[k] - ref["model"][k]).abs().max().item() for k in ref["model"])
    missing_opt = sorted(set(ref["optim"]) ^ set(fopt))
    optim_diff = max((abs(a - b) / max(abs(b), 1e-30) for k in ref["optim"] if k in fopt
                      for a, b in zip(fopt[k], ref["optim"][k])), default=float("nan"))
    losses = [train_step(eng, m, opt, spec, batch, clip=1.0) for _ in range(steps_after)]
    return {"model_diff": model_diff, "optim_diff": optim_diff, "optim_key_mismatch": missing_opt[:6],
            "losses": losses, "ref_losses": ref["losses"]}


# ------------------------------------------------------------------------------------- TE cases


def te_quantized(ctx: Context, recipe: str, meta: bool):
    """Seed test_fully_shard_te_quantized: FP8 parameters and activations through TE, HFSDP."""
    rec = P.build_fp8_recipe(typed(fp8=dict(recipe=recipe)).fp8)
    spec = spec_of("te_toy_fp8")
    m, _ = build(ctx, "te_toy_fp8", meta=meta, fp8_recipe=rec)
    outer = "optim" if ctx.dims.dp_outer > 1 else "no_shard"
    eng = engine_for(ctx, zero="optim_grads_params", outer=outer, compute="bf16", main_params="fp32",
                     keep_fp8_transpose_cache=recipe != "mxfp8", report_nan_in_param_grad=True)
    m = eng.shard(m, spec, init_on_meta=meta)
    opt = optimizer_for(eng, m)
    batch = toy_batch(spec, ctx, mbs=16)
    raw = list(getattr(m, "raw_param", {}).values())
    n_fp8 = sum(1 for p in raw if any(c.__name__ == "QuantizedTensor" for c in type(p).__mro__))
    losses = [train_step(eng, m, opt, spec, batch, fp8_recipe=rec) for _ in range(NUM_STEPS)]
    return {"losses": losses, "n_quantized_params": n_fp8}


def cuda_graph(ctx: Context, outer: str, replays: int = 8, model: str = "toy_transformer",
               compute: str = "fp32", loop_extras: bool = False):
    """Seed test_full_iteration_cuda_graph through cuda_graph.FullIterationCudaGraph.

    loop_extras adds what the training loop does around a replay (global-norm clipping, the LR
    scheduler, a logged-loss all-reduce): with the GPT in bf16 it is the worker's path minus
    data, metrics and checkpoints."""
    from mfsdp_launch.components.cuda_graph import FullIterationCudaGraph
    from mfsdp_launch.components.optim import build_scheduler

    spec = spec_of(model)
    m, _ = build(ctx, model, meta=False, seed=0)
    eng = engine_for(ctx, zero="optim_grads_params", outer=outer, compute=compute, main_params="fp32",
                     main_grads="fp32", cuda_graph=True)
    m = eng.shard(m, spec, init_on_meta=False)
    ocfg = typed(optim=dict(impl="te_fused", lr=0.01, weight_decay=0.0, warmup_steps=2)).optim
    opt = eng.wrap_optimizer(m, build_optimizer(m, ocfg))
    sched = build_scheduler(opt, ocfg, replays) if loop_extras else None
    batch = token_batch(ctx) if model == "gpt_tiny" else toy_batch(spec, ctx)
    graph = FullIterationCudaGraph(m, spec.loss, opt, lambda step, micro: batch)
    fsdp_group = m.dist_index.get_fsdp_group()
    losses, present = [], []
    for _ in range(replays):
        eng.set_grad_sync(m, True)
        loss = graph()
        if loop_extras:
            eng.clip_grad_norm(m, 1.0)
            logged = loss.detach().clone()
            dist.all_reduce(logged)
        torch.cuda.synchronize()
        present.append(any_over(grads_nonzero(m, ("grad", "decoupled_grad")), fsdp_group))
        losses.append(loss.detach().clone().item())
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=False)
    graph.release()
    return {"losses": losses, "grads_present": present, "capturable": bool(getattr(opt, "capturable", False))}


def _fp32_loss_step(e, m, o, spec, batch, rec) -> float:
    """One training step whose reported loss is computed in fp32 (the bf16 MSE rounds away the
    small differences a wrong FP8 scale makes)."""
    import torch.nn.functional as F

    e.set_grad_sync(m, True)
    with P.fp8_autocast(rec):
        out = m(batch["x"])
    loss = F.mse_loss(out.float(), batch["y"].float())
    loss.backward()
    o.step()
    o.zero_grad()
    return loss.item()


def _fp8_history(m) -> Dict[str, List[float]]:
    """Sums of each TE module's delayed-scaling scales and amax histories (fwd and bwd)."""
    from mfsdp_launch.engines.te_state import _delayed_state, te_modules

    out = {}
    for name, mod in te_modules(m.module):
        st = _delayed_state(getattr(mod, "fp8_meta", {}) or {})
        if st is not None:
            out[name] = [float(x.scale.double().sum()) for x in st] + [float(x.amax_history.double().sum()) for x in st]
    return out


def fp8_checkpoint(ctx: Context, steps_before: int = 3):
    """Delayed-scaling FP8 (FP8 params): the FP8 scaling history travels in te_extra_state, and
    the first steps after a resume match the uninterrupted run (fp32 loss)."""
    import torch.distributed.checkpoint as dcp

    rec = P.build_fp8_recipe(typed(fp8=dict(recipe="delayed")).fp8)
    spec = spec_of("te_toy_fp8")
    batch = toy_batch(spec, ctx, mbs=16)
    outer = "optim" if ctx.dims.dp_outer > 1 else "no_shard"

    def make(seed):
        m, _ = build(ctx, "te_toy_fp8", meta=False, seed=seed, fp8_recipe=rec)
        e = engine_for(ctx, zero="optim_grads_params", outer=outer, compute="bf16", main_params="fp32",
                       main_grads="fp32", keep_fp8_transpose_cache=True)
        m = e.shard(m, spec, init_on_meta=False)
        m.eval()  # no dropout: the compared losses must not depend on RNG
        return e, m, optimizer_for(e, m, lr=1e-3)

    e1, m1, o1 = make(0)
    for _ in range(steps_before):
        _fp32_loss_step(e1, m1, o1, spec, batch, rec)
    state = e1.state_dict(m1, o1)
    n_te = sum(1 for v in state.get("te_extra_state", {}).values() if v)
    saved_history = _fp8_history(m1)
    ckpt = ctx.tmpdir / "fp8_ckpt"
    dcp.save(state, checkpoint_id=str(ckpt))
    uninterrupted = [_fp32_loss_step(e1, m1, o1, spec, batch, rec) for _ in range(2)]

    def resumed(with_te: bool):
        e, m, o = make(1)
        st = e.state_dict(m, o)
        dcp.load(st, checkpoint_id=str(ckpt))
        if not with_te:
            st.pop("te_extra_state", None)
        e.load_state_dict(m, o, st)
        history = _fp8_history(m)
        return [_fp32_loss_step(e, m, o, spec, batch, rec) for _ in range(2)], history

    losses, history = resumed(True)
    losses_wo, history_wo = resumed(False)
    return {"n_te_modules_with_state": n_te, "uninterrupted": uninterrupted, "resumed": losses,
            "resumed_without_te_state": losses_wo,
            "history_restored": bool(saved_history) and history == saved_history,
            "history_differs_without": history_wo != saved_history}
