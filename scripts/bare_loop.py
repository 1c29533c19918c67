"""Reference training loop without the launcher: a DeviceMesh, fully_shard_model, the same GPT
(mfsdp_launch.models.llama.gpt_modules.GPT or te_modules.TEGPT), AdamW, timed steps. One JSON line on rank 0.

  torchrun --standalone --nproc-per-node 2 scripts/bare_loop.py --preset 1.4b --seq 2048 --mbs 4
  ... --model te_gpt --fp8 delayed [--fp8-params] [--profile 3]   (TE; profile prints top kernels)
"""
import argparse, json, os, sys, time
from contextlib import nullcontext

import torch, torch.distributed as dist, torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megatron_fsdp import MixedPrecisionPolicy, fully_shard_model, fully_shard_optimizer  # noqa: E402
from mfsdp_launch.models.llama.dims import flops_per_token, resolve_gpt_dims  # noqa: E402
from mfsdp_launch.models.llama.config import GPTModelConfig  # noqa: E402
from mfsdp_launch.core.schema import TrainConfig  # noqa: E402
from mfsdp_launch.engines.base import clip_to_norm, square_sum  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--model", default="gpt"); p.add_argument("--preset", default="1.4b")
p.add_argument("--seq", type=int, default=2048); p.add_argument("--mbs", type=int, default=4)
p.add_argument("--steps", type=int, default=20); p.add_argument("--warmup", type=int, default=5)
p.add_argument("--fp8", default="none"); p.add_argument("--fp8-params", action="store_true")
p.add_argument("--n-layers", type=int, default=None)
p.add_argument("--profile", type=int, default=0); p.add_argument("--peak", type=float, default=989.0)
# The launcher's default work per step: the global gradient norm and clipping to train.grad_clip
# (0: neither), so that launcher / bare compares the launcher, not the clipping.
p.add_argument("--grad-clip", type=float, default=TrainConfig.grad_clip)
a = p.parse_args()
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
mesh = init_device_mesh("cuda", (1, world, 1, 1), mesh_dim_names=("dp_outer", "dp_shard", "cp", "tp"))
cfg = GPTModelConfig(name=a.model, preset=a.preset, params_dtype="bf16", n_layers=a.n_layers)
dims = resolve_gpt_dims(cfg)
recipe = autocast = None
torch.manual_seed(0)
if a.model == "te_gpt":
    import transformer_engine.pytorch as te
    from transformer_engine.common import recipe as R
    from mfsdp_launch.models.llama.te_modules import TEGPT
    recipe = {"none": None, "delayed": R.DelayedScaling(), "current": R.Float8CurrentScaling(),
              "blockwise": R.Float8BlockScaling()}[a.fp8]
    init = te.quantized_model_init(recipe=recipe, preserve_high_precision_init_val=True) if a.fp8_params else nullcontext()
    with torch.device("meta"), init:
        model = TEGPT(dims, params_dtype=torch.bfloat16)
    units = [te.TransformerLayer, te.Linear]
    autocast = (lambda: te.autocast(enabled=True, recipe=recipe)) if recipe else None
else:
    from mfsdp_launch.models.llama.gpt_modules import GPT, Block
    with torch.device("meta"):
        model = GPT(dims, dtype=torch.bfloat16)
    units = [Block]
model = fully_shard_model(model, device_mesh=mesh, dp_shard_dim="dp_shard", tp_dim="tp", fsdp_unit_modules=units,
                          zero_dp_strategy=3, init_model_with_meta_device=True, keep_fp8_transpose_cache=a.fp8_params,
                          mixed_precision_policy=MixedPrecisionPolicy(main_params_dtype=torch.float32,
                                                                      main_grads_dtype=torch.float32))
opt = fully_shard_optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True))
ids = torch.randint(0, dims.vocab_size, (a.mbs, a.seq + 1), device="cuda")


def clip(max_norm):
    """Scale the local gradient shards by min(1, max_norm / global norm), without a host sync."""
    grads = []
    for q in model.parameters():
        g = getattr(q, "decoupled_grad", None)  # Megatron-FSDP's main gradient under FP8 weights
        g = q.grad if g is None else g
        if g is not None:
            grads.append(g._local_tensor if hasattr(g, "_local_tensor") else g)
    if not grads:
        return
    sq = square_sum(grads, torch.device("cuda"))
    dist.all_reduce(sq)
    clip_to_norm(grads, sq.sqrt(), max_norm)


def step():
    with (autocast() if autocast else nullcontext()):
        logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    if a.grad_clip:
        clip(a.grad_clip)
    opt.step()
    opt.zero_grad()
    return loss


for _ in range(a.warmup):
    step()
torch.cuda.synchronize(); t0 = time.perf_counter()
for _ in range(a.steps):
    loss = step()
torch.cuda.synchronize(); dt = (time.perf_counter() - t0) / a.steps
tps = a.mbs * a.seq / dt
res = {"name": f"bare_{a.model}_{a.preset}_{a.fp8}{'_params' if a.fp8_params else ''}_mbs{a.mbs}_seq{a.seq}",
       "engine": "bare megatron_fsdp", "model": a.model, "preset": a.preset, "seq": a.seq, "mbs": a.mbs,
       "precision": a.fp8 if a.fp8 != "none" else "bf16", "fp8_params": a.fp8_params, "world": world,
       "grad_clip": a.grad_clip,
       "tokens_per_s_per_gpu": tps, "mfu": flops_per_token(dims, a.seq) * tps / (a.peak * 1e12),
       "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "step_time_s": dt, "loss": loss.item()}
if a.profile:
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(a.profile):
            step()
        torch.cuda.synchronize()
    if rank == 0:
        try:
            table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70)
        except Exception:  # noqa: BLE001 - older torch names it cuda_time
            table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70)
        print(f"PROFILE {res['name']} ({a.profile} steps)\n{table}", flush=True)
if rank == 0:
    print("BENCH_JSON " + json.dumps(res), flush=True)
dist.destroy_process_group()
