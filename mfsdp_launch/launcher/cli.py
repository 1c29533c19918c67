"""`mfsdp-train`: compose once, then validate and launch (or sweep, or act as a rank under a
torchrun/srun someone else started). Nothing here imports torch, so `--help`, bad input and dry
runs answer fast."""

from __future__ import annotations

import errno
import os
import re
import sys
from typing import List, Optional, Tuple

from ..core import exit_codes
from ..core.console import eprint
from ..core.errors import ConfigError
from ..planner.compose import explain
from .launch import check, run_checked


HELP = """\
usage: mfsdp-train [+recipe=NAME] [key=value ...] [-m key=a,b ...] [--cfg] [--config-dir DIR]
       mfsdp-train --shell-completion install=bash

Compose a training config (Hydra groups + recipes + overrides), validate it, and launch it
with torchrun. Examples:
  mfsdp-train +recipe=cpu_smoke                          tiny GPT on CPU, 2 processes
  mfsdp-train +recipe=hfsdp_fp8 train.steps=2000         every visible GPU (launcher.nproc_per_node=auto)
  mfsdp-train +recipe=cpu_smoke launcher.dry_run=true    print mesh, ranks, memory; run nothing
  mfsdp-train -m +recipe=cpu_smoke optim.lr=1e-3,3e-3    a sweep: one torchrun job per point
  mfsdp-train --config-dir ~/my_configs +recipe=mine     your own recipes in ~/my_configs/recipe/

config groups: engine={engines}  model={models}
  data={datasets}  launcher={launchers}  +recipe=<name> (below)
main keys: mesh.{dp_outer,dp_shard,cp,tp}  sharding.{zero_dp_strategy,outer_dp_sharding_strategy}
  precision.{compute_dtype,main_params_dtype,main_grads_dtype,grad_comm_dtype}  fp8.recipe
  model.{preset,activation_checkpointing,loss_kernel,...}  engine.{nccl_ub,...}
  train.{steps,micro_batch_size,grad_accum_steps,seq_len,compile,profile,...}  optim.*  checkpoint.*
  run.{name,dir (a directory, or s3://BUCKET/PATH)}  launcher.{nproc_per_node (N|auto),nnodes,dry_run,...}
options:
  --cfg             print the composed config (every key and its value, and what the planner
                    resolves: dp_shard, the model's dims, ...) and exit
  --config-dir DIR  also look for config groups and recipes in DIR (DIR/recipe/NAME.yaml is
                    +recipe=NAME); same as hydra.searchpath=[file://DIR]
  --version         print the version and exit
  --shell-completion install=bash
                    print the bash completion of groups, recipes and keys: eval "$(mfsdp-train
                    --shell-completion install=bash)" (also zsh, fish; uninstall=bash)
{recipes}run.dir holds logs/ (the launcher's log, each rank's stdout/stderr), run.lock while a run owns
it, config.yaml, metrics.jsonl and checkpoints/. Ctrl-C, SIGTERM or a closed terminal: finish
the step, save, stop. Ctrl-Z pauses the ranks too (fg resumes).
"""

def help_text() -> str:
    """HELP with the names each registry knows (torch-free imports)."""
    from ..core.schema import Dataset
    from ..engines import ENGINES
    from ..models import names
    from ..planner.compose import available_options
    from ..planner.recipes import recipes_help

    return (HELP.replace("{engines}", "|".join(ENGINES)).replace("{models}", "|".join(names()))
            .replace("{datasets}", "|".join(d.value for d in Dataset))
            .replace("{launchers}", "|".join(available_options("launcher")))
            .replace("{recipes}", recipes_help()))


USAGE_HINT = """\
mfsdp-train: nothing to train: give a recipe or overrides, e.g.
  mfsdp-train +recipe=cpu_smoke                        a tiny GPT on CPU, 2 processes
  mfsdp-train +recipe=cpu_smoke launcher.dry_run=true  show the mesh and memory, run nothing
  mfsdp-train --help                                   every option and the exit codes
"""

FLAGS = ("-h", "--help", "--version", "--cfg", "-c", "--config-dir", "-cd", "-m", "--multirun", "--shell-completion",
         "-sc")


def in_worker_env() -> bool:
    """True under torchrun (or srun) started by someone else: then we are a rank, not a launcher."""
    if os.environ.get("TORCHELASTIC_RUN_ID") or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return True
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ and \
        os.environ.get("MFSDP_LAUNCHER") is None


def version() -> str:
    from .. import __version__

    return f"mfsdp-launch {__version__}"


# --- the command line before Hydra sees it --------------------------------------------------------


# What Hydra's override grammar takes in an unquoted value (OverrideLexer.g4): ASCII letters and
# digits, `_-/\\+.$%*@?|:`, whitespace, and the characters of its own syntax.
_UNQUOTED_OK = re.compile(r"^[A-Za-z0-9_\-/\\+.$%*@?|: \t]*$")
_SYNTAX = "[]{}(),'\""  # lists, dicts, sweeps, functions, quotes: the user's own structure
_PATH_KEY = re.compile(r"(^|\.)(dir|path|paths|tokenizer|cache_dir|pretrained|init_from|load_path)$")


def hydra_quote(value: str) -> str:
    """`value` as a single-quoted Hydra string: a quote and the backslashes before one escaped."""
    body = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", value)
    body = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, body)
    return f"'{body}'"


def quote_value(arg: str, sweep: bool = False) -> str:
    """`key=VALUE` with VALUE single-quoted when Hydra's grammar cannot read it bare: a `~`, a
    non-ASCII character, `=`, `#`, `&`, ... (a path like `runs/ünï x`); for path keys (run.dir,
    data.path, ...) also quotes, parentheses and, outside a sweep (`sweep`: -m), commas. A value
    that uses the grammar's own structure (a list, a dict, a sweep's commas, a quoted string) is
    left alone."""
    m = re.match(r"^([+~]{0,2}[\w./@-]+)=(.*)$", arg, re.S)
    if not m or not m.group(2):
        return arg
    key, value = m.group(1), m.group(2)
    if _UNQUOTED_OK.match(value) and not value.startswith("~"):
        return arg
    syntax = ("[]{}," if sweep else "[]{}") if _PATH_KEY.search(key.lstrip("+~")) else _SYNTAX
    if value[0] in "'\"" or any(c in value for c in syntax):
        return arg
    return f"{key}={hydra_quote(value)}"


def take_options(argv: List[str]) -> Tuple[List[str], dict]:
    """Split our options (--cfg [job], --config-dir DIR) from the overrides; ConfigError for an
    unknown --option."""
    overrides, opts, config_dirs = [], {"cfg": False}, []
    sweep = any(a in ("-m", "--multirun") for a in argv)
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("--cfg", "-c") or a.startswith("--cfg="):
            opts["cfg"] = True
            if a in ("--cfg", "-c") and i + 1 < len(argv) and argv[i + 1] in ("job", "all", "hydra"):
                i += 1  # Hydra's spelling: --cfg job
        elif a in ("--config-dir", "-cd") or a.startswith("--config-dir="):
            value = a.split("=", 1)[1] if "=" in a else (argv[i + 1] if i + 1 < len(argv) else "")
            i += 0 if "=" in a else 1
            if not value:
                raise ConfigError("--config-dir", "needs a directory", "--config-dir DIR")
            config_dirs.append(value)
        elif a.startswith("-") and a not in ("-m", "--multirun"):
            raise ConfigError(a, "unknown option", "|".join(f for f in FLAGS if f.startswith("--")) +
                              " and key=value overrides")
        else:
            overrides.append(quote_value(a, sweep))
        i += 1
    if any(re.match(r"^[+~]{0,2}recipe=?$", o) for o in overrides):  # `+recipe=`: which are there?
        from ..planner.recipes import recipes

        raise ConfigError("+recipe", "names no recipe", "|".join(recipes(config_dirs)))
    if config_dirs:
        overrides = add_search_path(overrides, config_dirs)
    return overrides, opts


def add_search_path(overrides: List[str], dirs: List[str]) -> List[str]:
    """`--config-dir DIR` as Hydra's `hydra.searchpath=[file://DIR]` (added to one given)."""
    entries = []
    for d in dirs:
        path = os.path.abspath(os.path.expanduser(d))
        if not os.path.isdir(path):
            raise ConfigError("--config-dir", f"{path} is not a directory", "a folder holding config groups, "
                              "e.g. DIR/recipe/NAME.yaml")
        entries.append(f"file://{path}")
    out, merged = [], False
    for o in overrides:
        m = re.match(r"^(hydra\.searchpath)=\[(.*)\]$", o)
        if m:
            existing = [e for e in m.group(2).split(",") if e.strip()]
            o = f"hydra.searchpath=[{','.join(existing + entries)}]"
            merged = True
        out.append(o)
    if not merged:
        out.append(f"hydra.searchpath=[{','.join(entries)}]")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(help_text() + exit_codes.help_text(), end="")
        return exit_codes.OK
    if "--version" in argv:
        print(version())
        return exit_codes.OK
    if any(a in ("--shell-completion", "-sc") or a.startswith("--shell-completion=") for a in argv):
        from .completion import completion_args, shell_completion

        try:
            shell_completion(completion_args(argv))
        except ConfigError as exc:
            eprint(f"mfsdp-train: error: {exc}")
            return exit_codes.CONFIG
        return exit_codes.OK
    if not argv:
        eprint(USAGE_HINT.rstrip("\n"))
        return exit_codes.CONFIG
    try:
        overrides, opts = take_options(argv)
    except ConfigError as exc:
        eprint(f"mfsdp-train: error: {exc}")
        return exit_codes.CONFIG
    if any(a in ("-m", "--multirun") for a in overrides):
        from .sweep import run_sweep

        if opts["cfg"]:
            eprint("mfsdp-train: error: --cfg: not supported with -m/--multirun "
                   "(allowed: key=value overrides; launcher.dry_run=true shows each job)")
            return exit_codes.CONFIG

        return run_sweep(overrides)
    cfg = None
    try:
        from ..planner.compose import compose

        cfg = compose(overrides)
        if opts["cfg"]:
            from ..planner.show_config import annotated_yaml

            print(annotated_yaml(cfg), end="")  # as Hydra's --cfg (run nothing), with what resolves
            return exit_codes.OK
        if in_worker_env():
            from ..rank.worker import run_as_external_worker

            return run_as_external_worker(cfg, overrides)
        return run_checked(cfg, check(cfg), overrides)
    except ConfigError as exc:
        eprint(f"mfsdp-train: error: {explain(exc)}")
        return exit_codes.CONFIG
    except OSError as exc:
        if exc.errno not in DISK_FULL:
            raise
        # config.yaml, run.lock, the launcher's log: the run dir's disk took no more.
        where = exc.filename or (cfg.run.dir if cfg is not None else "run.dir")
        eprint(f"mfsdp-train: error: run.dir: cannot write {where}: {exc.strerror} "
               f"({DISK_FULL[exc.errno]}; allowed: free space there, or another run.dir)")
        return exit_codes.CONFIG


DISK_FULL = {errno.ENOSPC: "its disk is full", errno.EDQUOT: "the disk quota is used up",
             errno.EFBIG: "a file-size limit (ulimit -f) is reached"}
