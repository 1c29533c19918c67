"""`mfsdp-train`: compose once, then validate and launch (or sweep, or act as a rank under a
torchrun/srun someone else started). Nothing here imports torch, so `--help`, bad input and dry
runs answer fast."""

from __future__ import annotations

import os
import sys
from typing import List, Optional

from .console import eprint
from .errors import ConfigError
from .launch import check, run_checked


HELP = """\
usage: mfsdp-train [+recipe=NAME] [key=value ...] [-m key=a,b ...]

Compose a training config (Hydra groups + recipes + overrides), validate it, and launch it
with torchrun. Examples:
  mfsdp-train +recipe=cpu_smoke                          tiny GPT on CPU, 2 processes
  mfsdp-train +recipe=hfsdp_fp8 mesh.dp_shard=8 train.steps=2000
  mfsdp-train +recipe=cpu_smoke launcher.dry_run=true    print mesh, ranks, memory; run nothing
  mfsdp-train -m +recipe=cpu_smoke optim.lr=1e-3,3e-3    a sweep: one torchrun job per point

config groups: engine=fsdp2|megatron_fsdp  model=gpt|te_gpt|toy_cnn|toy_transformer|
  te_toy_transformer  data=synthetic|text  launcher=torchrun|slurm  +recipe=<name>
main keys: mesh.{dp_outer,dp_shard,cp,tp}  sharding.{zero_dp_strategy,outer_dp_sharding_strategy}
  precision.{compute_dtype,main_params_dtype,main_grads_dtype,grad_comm_dtype}  fp8.recipe
  train.{steps,micro_batch_size,grad_accum_steps,seq_len,compile,...}  optim.*  checkpoint.*
  run.{name,dir}  launcher.{nproc_per_node,nnodes,node_rank,rdzv_endpoint,dry_run}
Show every key and its value: mfsdp-train <overrides> launcher.dry_run=true --cfg
Exit codes: 0 done, 2 bad config (one line naming the key), other: the training job failed.
"""


def in_worker_env() -> bool:
    """True under torchrun (or srun) started by someone else: then we are a rank, not a launcher."""
    if os.environ.get("TORCHELASTIC_RUN_ID") or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ and \
        os.environ.get("MFSDP_LAUNCHER") is None


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(HELP, end="")
        return 0
    if any(a in ("-m", "--multirun") for a in argv):
        from .sweep import run_sweep

        return run_sweep(argv)
    show_cfg = "--cfg" in argv
    overrides = [a for a in argv if a != "--cfg"]
    try:
        from .config.compose import compose

        cfg = compose(overrides)
        if in_worker_env():
            from .worker import run_as_external_worker

            return run_as_external_worker(cfg, overrides)
        warnings = check(cfg)
    except ConfigError as exc:
        eprint(f"mfsdp-train: error: {exc}")
        return 2
    if show_cfg:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(cfg), end="")
    return run_checked(cfg, warnings, overrides)
