"""Checkpoints: sharded (DCP), committed atomically, resumable at another world size.

Layout, in ``run.dir/checkpoints/``::

    step_<N>/            a committed checkpoint (it has a manifest.json naming every file)
        .metadata, __<r>_0.distcp   DCP checkpoint of {"model": ..., "optimizer": ...}
        extra_rank<r>.pt            rank r's RNG states (torch CPU, CUDA, python, numpy)
        trainer.json                step, tokens_seen, consumed_samples, LR scheduler state
        scheduler.pt                only when the scheduler state is not JSON-able
        manifest.json               written LAST: step, config hash, model/mesh/engine sections,
                                    world size, versions, times, the list of files with sizes
    step_<N>.tmp/        a save in progress (or a crashed one): never a resume point
    latest               the name of the newest committed step directory, for people and tools

Commit protocol: every rank writes into ``step_<N>.tmp``; the ranks agree that all writes
succeeded (an all_gather of error strings on the checkpoint process group, which doubles as the
barrier); rank 0 then writes ``manifest.json`` (tmp file, fsync, os.replace), renames the directory
to ``step_<N>`` (an older ``step_<N>`` is moved away only once the new one is complete), fsyncs
the parent, and replaces ``latest``. A second agreement makes every rank return only after the
commit. Stale ``*.tmp`` entries are removed by rank 0 when a manager starts; committed
directories never are.

Decisions (the issue left these to us):

* Resume point: the highest step whose directory is intact (manifest readable, every listed file
  present with its recorded size). ``latest`` is written for people and tools but never trusted
  for the decision, so a pointer to a deleted or older directory cannot mislead a resume.
  A run's history is linear: committing step M removes the step directories above M, which
  belong to a timeline this run abandoned (``load_step`` to an earlier step, ``resume=never`` in
  a used run.dir, or a damaged newer checkpoint). The resume line warns about it beforehand.
* ``resume=auto`` with checkpoints present but none intact refuses to start (ConfigError) rather
  than silently training from scratch; ``resume=never`` is the way to start over.
* ``load_path`` is an initialisation source: with ``resume=auto|must`` it is used only when the
  run's own directory has no checkpoint, so a preempted fine-tune resumes its own progress.
  ``resume=never`` ignores the run's own checkpoints but still loads ``load_path``. ``load_step``
  always wins (explicit): the step of ``load_path`` if given, else of the run's own directory.
* Config changes at a resume: the model shape (name, resolved dims, vocab, tied embeddings),
  ``model.freeze`` (optimizer state layout) and the engine are refused; everything else (mesh,
  world size, LR, steps, logging, checkpoint settings) is allowed and printed. The current
  config's optimizer hyper-parameters and base LR win over the checkpoint's, so an LR change
  takes effect (a LambdaLR's LR is recomputed from the new base LR at the restored step).
  With ``load_weights_only`` only the model shape matters; keys are matched after stripping
  wrapper prefixes, so weights load across engines.
* RNG: rank r restores ``extra_rank<r>.pt``. After a world-size change, ranks without a saved
  file seed torch/CUDA/python/numpy from ``(train.seed, rank, step)`` (see ``fallback_seed``).
  Data positions need nothing: the data module derives them from ``consumed_samples``.
* A failed save (full disk, any OSError, a failed async write) removes the ``.tmp`` directory,
  keeps every committed checkpoint, and raises ``CheckpointError`` on every rank, naming the
  failing ranks and the checkpoint that is still there. We stop rather than train on while
  nothing can be saved.
* Async saves (``checkpoint.async_save``): ``dcp.async_save`` stages a CPU copy of the state on
  the calling thread, then writes from a background thread over a dedicated gloo group (torch
  2.13 asserts the group has a CPU backend, and a group used by a background thread must not be
  used by the training thread). While a save is in flight every ``maybe_save`` call polls it with
  one tiny all_gather on the checkpoint group, so all ranks commit in the same call; the next save
  and ``wait()`` block until it is done. Final and forced saves are committed before
  ``maybe_save`` returns. On torch >= 2.13 one stager is kept for the run, so its CPU staging
  buffers (pinned under CUDA) are refilled at each save instead of allocated again (it holds one
  copy of this rank's state in host memory); older torch uses torch's default staging. ``maybe_save`` and ``wait`` must be called by every rank, in the same
  order, with the same arguments.

Everything the launcher needs (``preflight``, finding, validating and pruning checkpoints) is pure
Python + json: torch is imported only inside ``CheckpointManager`` and the load/save helpers.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from .atomic_io import atomic_write
from .errors import ConfigError

CHECKPOINTS = "checkpoints"
LATEST = "latest"
MANIFEST = "manifest.json"
TRAINER = "trainer.json"
SCHEDULER_FILE = "scheduler.pt"
DCP_METADATA = ".metadata"
FORMAT = "mfsdp-launch-checkpoint/1"
TMP_SUFFIX = ".tmp"

_STEP_RE = re.compile(r"^step_(\d+)$")

# Model config fields that decide the saved tensors' shapes (compared when dims can't be resolved).
_SHAPE_CONFIG_KEYS = ("preset", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                      "tie_embeddings", "output_dim")


class CheckpointError(RuntimeError):
    """A save or load that failed at run time (the config was fine)."""


def _print(msg: str) -> None:
    print(msg, flush=True)


# ============================================================================================
# Layout (pure Python)


def step_name(step: int) -> str:
    return f"step_{int(step)}"


def parse_step(name: str) -> Optional[int]:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir).expanduser().absolute() / CHECKPOINTS


def list_step_dirs(ckpt_dir: str | os.PathLike) -> List[Tuple[int, Path]]:
    """(step, path) of every `step_<N>` directory (committed or damaged, never `.tmp`), by step."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    out = []
    for p in ckpt_dir.iterdir():
        step = parse_step(p.name)
        if step is not None and p.is_dir():
            out.append((step, p))
    return sorted(out)


def inspect_checkpoint(step_dir: str | os.PathLike) -> Tuple[Optional[dict], Optional[str]]:
    """(manifest, None) for an intact committed checkpoint, else (None, what is wrong)."""
    step_dir = Path(step_dir)
    mpath = step_dir / MANIFEST
    if not mpath.is_file():
        return None, f"missing {MANIFEST}"
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        return None, f"unreadable {MANIFEST} ({type(exc).__name__})"
    if not isinstance(manifest, dict) or not isinstance(manifest.get("step"), int) \
            or not isinstance(manifest.get("files"), list):
        return None, f"{MANIFEST} lacks step/files"
    dir_step = parse_step(step_dir.name)
    if dir_step is not None and manifest["step"] != dir_step:
        return None, f"{MANIFEST} says step {manifest['step']}"
    names = set()
    for entry in manifest["files"]:
        try:
            rel, size = str(entry["path"]), int(entry["bytes"])
        except (KeyError, TypeError, ValueError):
            return None, f"{MANIFEST} has a malformed file entry"
        names.add(rel)
        p = step_dir / rel
        if not p.is_file():
            return None, f"missing {rel}"
        actual = p.stat().st_size
        if actual != size:
            return None, f"{rel} has {actual} bytes, the manifest says {size}"
    if DCP_METADATA not in names:
        return None, f"{MANIFEST} lists no DCP {DCP_METADATA}"
    return manifest, None


@dataclass
class Found:
    """An intact committed checkpoint."""

    path: Path
    step: int
    manifest: dict

    @property
    def name(self) -> str:
        return self.path.name


def find_latest(ckpt_dir: str | os.PathLike) -> Tuple[Optional[Found], List[Tuple[Path, str]]]:
    """The highest intact committed checkpoint, and the damaged step directories above it."""
    damaged: List[Tuple[Path, str]] = []
    for step, path in reversed(list_step_dirs(ckpt_dir)):
        manifest, problem = inspect_checkpoint(path)
        if problem is None:
            return Found(path, step, manifest), damaged
        damaged.append((path, problem))
    return None, damaged


def committed_steps(ckpt_dir: str | os.PathLike) -> List[int]:
    """Steps of the intact committed checkpoints, ascending."""
    return [s for s, p in list_step_dirs(ckpt_dir) if inspect_checkpoint(p)[1] is None]


def read_latest_pointer(ckpt_dir: str | os.PathLike) -> Optional[str]:
    try:
        return (Path(ckpt_dir) / LATEST).read_text().strip() or None
    except OSError:
        return None


def stale_tmp_entries(ckpt_dir: str | os.PathLike) -> List[Path]:
    """Leftovers of crashed saves/commits: every `*.tmp` entry (never a committed directory)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.iterdir() if p.name.endswith(TMP_SUFFIX))


def prune_plan(entries: Iterable[Tuple[int, Path, bool]], keep_last: int,
               protect: Iterable[Path] = ()) -> List[Path]:
    """Which step directories to delete: all below the `keep_last` newest intact ones.

    `entries` are (step, path, intact). The newest intact one is always kept (keep_last >= 1);
    `protect` (the checkpoint this run resumed from) is never deleted. Damaged directories newer
    than the oldest kept one stay, for inspection.
    """
    entries = sorted(entries, key=lambda e: e[0], reverse=True)
    protect = {Path(p) for p in protect}
    kept, cutoff = 0, None
    for step, _path, intact in entries:
        if intact:
            kept += 1
            if kept >= max(1, keep_last):
                cutoff = step
                break
    if cutoff is None:
        return []
    return [Path(p) for s, p, _ in entries if s < cutoff and Path(p) not in protect]


def _steps_text(steps: List[int]) -> str:
    return ", ".join(str(s) for s in steps) if steps else "none"


def resolve_checkpoint(path: str | os.PathLike, *, step: Optional[int] = None,
                       key: str = "checkpoint.load_path") -> Found:
    """A committed checkpoint from a step directory, a checkpoints directory or a run directory.

    Without `step`, a checkpoints/run directory gives its newest intact checkpoint. Raises
    ConfigError under `key` when there is none, naming the directory.
    """
    p = Path(path).expanduser().absolute()
    if not p.exists():
        raise ConfigError(key, f"{p} does not exist")
    if parse_step(p.name) is not None or (p / MANIFEST).exists() or p.name.endswith(TMP_SUFFIX):
        if p.name.endswith(TMP_SUFFIX):
            raise ConfigError(key, f"{p} is an uncommitted save (.tmp), not a checkpoint")
        manifest, problem = inspect_checkpoint(p)
        if problem:
            raise ConfigError(key, f"{p} is damaged ({problem})")
        if step is not None and manifest["step"] != step:
            raise ConfigError("checkpoint.load_step", f"{step} but checkpoint.load_path {p} is step "
                              f"{manifest['step']}", str(manifest["step"]))
        return Found(p, manifest["step"], manifest)
    root = p / CHECKPOINTS if (p / CHECKPOINTS).is_dir() else p
    if not list_step_dirs(root) and not stale_tmp_entries(root) and not (root / LATEST).exists():
        raise ConfigError(key, f"{p} is not a checkpoint (no {MANIFEST}, no step_<N> directories)")
    if step is not None:
        return require_step(root, step, key="checkpoint.load_step")
    found, damaged = find_latest(root)
    if found is None:
        why = "; ".join(f"{d.name} is damaged ({w})" for d, w in damaged) or "no committed checkpoint"
        raise ConfigError(key, f"{root} has no intact checkpoint: {why}")
    return found


def require_step(ckpt_dir: Path, step: int, *, key: str = "checkpoint.load_step") -> Found:
    """The committed checkpoint `step` of `ckpt_dir`, or a ConfigError saying what is there."""
    target = Path(ckpt_dir) / step_name(step)
    if target.is_dir():
        manifest, problem = inspect_checkpoint(target)
        if problem is None:
            return Found(target, step, manifest)
        state = f"{target} exists but is damaged ({problem})"
    elif (Path(ckpt_dir) / (step_name(step) + TMP_SUFFIX)).exists():
        state = f"{target} was never committed (only {target.name}{TMP_SUFFIX}, an interrupted save)"
    else:
        state = f"{target} does not exist"
    available = committed_steps(ckpt_dir)  # validates every step directory: only for the message
    raise ConfigError(key, f"{step}: {state}; committed steps in {ckpt_dir}: {_steps_text(available)}",
                      _steps_text(available) if available else None)


# ============================================================================================
# Manifest sections and compatibility (pure Python)


def _get(node, key, default=None):
    if node is None:
        return default
    if isinstance(node, dict):
        return node.get(key, default)
    try:
        return getattr(node, key)
    except Exception:
        return default


def _plain(value):
    """OmegaConf nodes / tuples -> plain JSON types."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(value, (DictConfig, ListConfig)):
            return OmegaConf.to_container(value, resolve=True, enum_to_str=True)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(value, enum.Enum):
        return value.name
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: _plain(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def model_section(model_cfg) -> dict:
    """What the checkpoint records about the model; `shape` is the resolved dims (torch-free)."""
    name = str(_get(model_cfg, "name"))
    section: Dict[str, Any] = {k: _plain(_get(model_cfg, k)) for k in ("name",) + _SHAPE_CONFIG_KEYS}
    section["freeze"] = list(_plain(_get(model_cfg, "freeze", [])) or [])
    section["params_dtype"] = _get(model_cfg, "params_dtype")
    shape = None
    try:
        from .models import family

        shape = family(name).shape(model_cfg)
        if name.startswith("te_"):
            shape["fuse_qkv"] = bool(_get(model_cfg, "fuse_qkv", False))
    except Exception:  # an unresolvable model is validation's business, not ours
        shape = None
    section["shape"] = shape
    return section


def engine_section(cfg) -> dict:
    sh, pc = _get(cfg, "sharding"), _get(cfg, "precision")
    return {
        "name": _get(_get(cfg, "engine"), "name"),
        "zero_dp_strategy": _plain(_get(sh, "zero_dp_strategy")),
        "outer_dp_sharding_strategy": _plain(_get(sh, "outer_dp_sharding_strategy")),
        "main_params_dtype": _get(pc, "main_params_dtype"),
        "compute_dtype": _get(pc, "compute_dtype"),
    }


def mesh_section(cfg, world_size: int) -> dict:
    mesh = {k: _get(_get(cfg, "mesh"), k) for k in ("dp_outer", "dp_shard", "cp", "tp")}
    mesh["world_size"] = int(world_size)
    return mesh


def collect_versions() -> dict:
    """Installed versions of the stack, from package metadata (does not import torch); the keys are
    the distribution names, None when not installed."""
    from importlib import metadata

    from . import __version__

    out = {}
    for pkg in ("torch", "megatron-fsdp", "transformer-engine", "mfsdp-launch"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    if out["mfsdp-launch"] is None:
        out["mfsdp-launch"] = __version__ + "+src"
    return out


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def manifest_info_from_config(cfg, *, world_size: Optional[int] = None,
                              versions: Optional[dict] = None) -> dict:
    """The `manifest_info` a worker passes to CheckpointManager (and what preflight compares).

    Pure Python. `cfg` is the resolved config (OmegaConf or dataclass).
    """
    config = _plain(cfg)
    if world_size is None:
        lc = _get(cfg, "launcher")
        world_size = int(_get(lc, "nnodes", 1)) * int(_get(lc, "nproc_per_node", 1))
    return {
        "config_hash": config_hash(config),
        "model": model_section(_get(cfg, "model")),
        "mesh": mesh_section(cfg, world_size),
        "engine": engine_section(cfg),
        "versions": dict(versions) if versions is not None else collect_versions(),
        "seed": _get(_get(cfg, "train"), "seed", 0),
        "config": config,
    }


def _shape_of(section: dict) -> Optional[dict]:
    """Resolved dims of a manifest's model section: its `shape`, or resolved from its config
    fields (a section written as the raw model config)."""
    if isinstance(section.get("shape"), dict):
        return section["shape"]
    from .config.schema import ModelConfig

    base = ModelConfig()
    for k, v in section.items():
        if hasattr(base, k):
            setattr(base, k, v)
    return model_section(base)["shape"]


def incompatibilities(current: dict, manifest: dict, *, weights_only: bool) -> List[Tuple[str, Any, Any]]:
    """(key, value now, value in the checkpoint) for each change that cannot resume."""
    out: List[Tuple[str, Any, Any]] = []
    cur_m, old_m = current.get("model") or {}, manifest.get("model") or {}
    if cur_m and old_m:
        if "name" in cur_m and "name" in old_m and cur_m["name"] != old_m["name"]:
            out.append(("model.name", cur_m["name"], old_m["name"]))
        else:
            cs, os_ = _shape_of(cur_m), _shape_of(old_m)
            if isinstance(cs, dict) and isinstance(os_, dict):
                for sk in sorted(set(cs) | set(os_)):
                    if cs.get(sk) != os_.get(sk):
                        out.append((f"model.{sk}", cs.get(sk), os_.get(sk)))
            else:  # unresolvable on one side: compare the config fields
                for sk in _SHAPE_CONFIG_KEYS:
                    if sk in cur_m and sk in old_m and cur_m[sk] != old_m[sk]:
                        out.append((f"model.{sk}", cur_m[sk], old_m[sk]))
        if not weights_only and "freeze" in cur_m and "freeze" in old_m \
                and _plain(cur_m["freeze"] or []) != _plain(old_m["freeze"] or []):
            out.append(("model.freeze", cur_m["freeze"], old_m["freeze"]))
    if not weights_only:
        ce, oe = (current.get("engine") or {}).get("name"), (manifest.get("engine") or {}).get("name")
        if ce and oe and ce != oe:
            out.append(("engine", ce, oe))
    return out


def _flatten(d: Any, prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = d
    return out


def config_changes(current: dict, manifest: dict, *, limit: int = 12) -> List[str]:
    """Human-readable allowed differences (config keys, world size, versions) vs a manifest."""
    changes = []
    cur_cfg, old_cfg = current.get("config"), manifest.get("config")
    if isinstance(cur_cfg, dict) and isinstance(old_cfg, dict):
        a, b = _flatten(old_cfg), _flatten(cur_cfg)
        for k in sorted(set(a) | set(b)):
            if _plain(a.get(k)) != _plain(b.get(k)):
                changes.append(f"{k} {a.get(k)!r} -> {b.get(k)!r}")
    else:
        # No full configs recorded: the mesh and engine sections still show what changed.
        for section in ("mesh", "engine"):
            a = {k: v for k, v in (manifest.get(section) or {}).items() if k != "world_size"}
            b = {k: v for k, v in (current.get(section) or {}).items() if k != "world_size"}
            for k in sorted(set(a) & set(b)):
                if _plain(a[k]) != _plain(b[k]):
                    changes.append(f"{section}.{k} {a[k]!r} -> {b[k]!r}")
    old_ws = manifest.get("world_size", (manifest.get("mesh") or {}).get("world_size"))
    new_ws = (current.get("mesh") or {}).get("world_size")
    if old_ws is not None and new_ws is not None and old_ws != new_ws:
        changes.append(f"world size {old_ws} -> {new_ws} (DCP reshards model and optimizer)")
    ov, nv = manifest.get("versions") or {}, current.get("versions") or {}
    for k in sorted(set(ov) & set(nv)):
        if ov[k] != nv[k]:
            changes.append(f"{k} {ov[k]} -> {nv[k]}")
    if len(changes) > limit:
        changes = changes[:limit] + [f"... and {len(changes) - limit} more"]
    return changes


# ============================================================================================
# The resume decision (pure Python; preflight and the workers' rank 0 run the same code)


@dataclass
class ResumePlan:
    kind: str  # "fresh" | "resume" | "weights"
    line: str  # the one decision line
    notes: List[str] = field(default_factory=list)  # printed before it (damaged fallbacks, ...)
    found: Optional[Found] = None
    own: bool = False  # the checkpoint is in this run's own directory

    @property
    def step(self) -> Optional[int]:
        return self.found.step if self.found else None


def plan_resume(ck, ckpt_dir: str | os.PathLike) -> ResumePlan:
    """Decide what a run with checkpoint config `ck` and own checkpoints in `ckpt_dir` loads."""
    ckpt_dir = Path(ckpt_dir).expanduser().absolute()
    resume = str(_get(ck, "resume", "auto"))
    load_step, load_path = _get(ck, "load_step"), _get(ck, "load_path")
    weights_only = bool(_get(ck, "load_weights_only", False))
    notes: List[str] = []

    def loaded(found: Found, own: bool) -> ResumePlan:
        if weights_only and not own:
            return ResumePlan("weights", f"starting fresh from the model weights of step {found.step} "
                              f"({found.path}): checkpoint.load_weights_only=true (fresh optimizer "
                              "and schedule, step 0)", notes, found, own)
        return ResumePlan("resume", f"resuming from step {found.step} ({found.path})", notes, found, own)

    if load_step is not None:
        if load_path:
            return loaded(resolve_checkpoint(load_path, step=int(load_step)), False)
        found = require_step(ckpt_dir, int(load_step))
        # Only the directories above found.step need checking (committed_steps would check all).
        newer = [s for s, p in list_step_dirs(ckpt_dir)
                 if s > found.step and inspect_checkpoint(p)[1] is None]
        if newer:
            notes.append(f"checkpoint.load_step={found.step}: {', '.join(step_name(s) for s in newer)} in "
                         f"{ckpt_dir} are later; this run's first save removes them")
        return loaded(found, True)

    if resume == "never":
        if load_path:
            return loaded(resolve_checkpoint(load_path), False)
        existing = [step_name(s) for s, _ in list_step_dirs(ckpt_dir)]
        why = "checkpoint.resume=never"
        if existing:
            why += f" (the checkpoints in {ckpt_dir}, {', '.join(existing)}, are replaced as this run saves)"
        return ResumePlan("fresh", f"starting fresh: {why}", notes)

    own_found, own_damaged = find_latest(ckpt_dir)
    if own_found is not None:
        for path, problem in own_damaged:
            notes.append(f"{path.name} is damaged ({problem}), falling back to {own_found.name}")
        if load_path:
            notes.append(f"checkpoint.load_path={load_path} is not used: {ckpt_dir} has its own checkpoint "
                         "(load_path only initialises a run that has none)")
        return loaded(own_found, True)
    if own_damaged:
        why = "; ".join(f"{p.name} is damaged ({w})" for p, w in own_damaged)
        raise ConfigError("checkpoint.resume", f"{resume}, but {ckpt_dir} has no intact checkpoint: {why}",
                          "checkpoint.resume=never to start over, or repair/remove the damaged directories")
    if load_path:
        return loaded(resolve_checkpoint(load_path), False)
    if resume == "must":
        raise ConfigError("checkpoint.resume", f"must, but {ckpt_dir} has no committed checkpoint",
                          "auto|never, or a run.dir with checkpoints")
    return ResumePlan("fresh", f"starting fresh: no checkpoint in {ckpt_dir}", notes)


def _refusal(plan: ResumePlan, problems: List[Tuple[str, Any, Any]]) -> ConfigError:
    key, now, old = problems[0]
    verb = "load" if plan.kind == "weights" else "resume"
    what = "the engine's state layout" if key == "engine" else "the model's saved tensors"
    extra = f" (and {', '.join(p[0] for p in problems[1:])})" if len(problems) > 1 else ""
    allowed = f"{old!r} as in the checkpoint, or checkpoint.resume=never / a new run.dir to start over"
    if key == "engine":
        allowed += ", or checkpoint.load_path=<it> checkpoint.load_weights_only=true in a new run.dir"
    return ConfigError(key, f"{now!r} here but {old!r} in {plan.found.path}, the checkpoint this run would "
                       f"{verb}{extra}: a change of {what} cannot {verb}", allowed)


def preflight(cfg) -> None:
    """Launcher-side checks before spawning (pure Python; never imports torch).

    Raises ConfigError when the checkpoint config cannot run against what is on disk: resume=must
    with nothing committed, a load_step that is not committed, a bad load_path, or a refused
    change (model shape, engine) vs the checkpoint that would be loaded.
    """
    ck = cfg.checkpoint
    plan = plan_resume(ck, checkpoints_dir(cfg.run.dir))
    if plan.kind == "fresh":
        return
    current = manifest_info_from_config(cfg, versions={})
    problems = incompatibilities(current, plan.found.manifest, weights_only=plan.kind == "weights")
    if problems:
        raise _refusal(plan, problems)


# ============================================================================================
# Worker side: saving and loading (torch)


def fallback_seed(seed: int, rank: int, step: int) -> int:
    """Seed for a rank that has no saved RNG state (a resume at a larger world size)."""
    h = hashlib.sha256(f"mfsdp-rng:{int(seed)}:{int(rank)}:{int(step)}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(str(path), os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, write) -> None:
    """`write(file)` into `<path>.tmp`, fsync, rename to `path`, fsync the directory."""
    # The fixed `.tmp` name: a crash's leftover is one that stale_tmp_entries removes.
    atomic_write(path, write, tmp=str(path) + TMP_SUFFIX)
    _fsync_dir(path.parent)


def saved_model_keys(md, *, path, key: str) -> Dict[str, str]:
    """{name without wrapper prefixes: saved key without "model."} of a DCP checkpoint's metadata;
    a ConfigError under `key` when two saved keys map to one name."""
    from .engines.base import strip_prefixes

    out: Dict[str, str] = {}
    for k in md.state_dict_metadata:
        if k.startswith("model."):
            sub = k[len("model."):]
            name = strip_prefixes(sub)
            if name in out:
                raise ConfigError(key, f"{path}: keys {sub!r} and another both map to {name!r}")
            out[name] = sub
    return out


def _list_files(root: Path) -> List[dict]:
    files = []
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            p = Path(dirpath) / n
            rel = p.relative_to(root).as_posix()
            if rel != MANIFEST:
                files.append({"path": rel, "bytes": p.stat().st_size})
    return sorted(files, key=lambda f: f["path"])


def quiet_single_process_warnings() -> None:
    """DCP warns at every call without a process group; in a single process that is the intent."""
    import warnings

    warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled, )?unavailable")


def _jsonable(obj) -> bool:
    try:
        json.dumps(obj, allow_nan=True)
        return True
    except (TypeError, ValueError):
        return False


class CheckpointManager:
    """Saves and resumes one run's checkpoints. Construct it on every rank (it is collective)."""

    def __init__(self, ckpt_cfg, run_dir, *, manifest_info: dict, rank: int, world_size: int, engine,
                 process_group=None):
        import torch.distributed as dist

        self.cfg = ckpt_cfg
        self.run_dir = Path(run_dir).expanduser().absolute()
        self.dir = self.run_dir / CHECKPOINTS
        self.info = dict(manifest_info or {})
        self.rank, self.world_size = int(rank), int(world_size)
        self.engine = engine
        self.pg = process_group
        self._dist = dist.is_available() and dist.is_initialized()
        if not self._dist:
            quiet_single_process_warnings()
        self.last_save_seconds = 0.0
        self.last_blocked_seconds = 0.0
        self.resumed_path: Optional[Path] = None
        self._have_steps: set = set()  # steps whose state is already on disk in self.dir
        self._pending: Optional[dict] = None
        self._async_pg = None
        self._staging = None
        if self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            for p in stale_tmp_entries(self.dir):
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
        if bool(_get(ckpt_cfg, "async_save", False)) and self._dist:
            # The background writer gets its own gloo group: async_save needs a CPU backend, and a
            # group used from another thread must not be shared with the training thread.
            self._async_pg = dist.new_group(backend="gloo")
        self._barrier()

    # -------------------------------------------------------------------- collectives

    def _gather(self, obj) -> list:
        if not self._dist or self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def _barrier(self) -> None:
        self._gather(None)

    def _broadcast(self, obj):
        if not self._dist or self.world_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        src = dist.get_global_rank(self.pg, 0) if self.pg is not None else 0
        dist.broadcast_object_list(box, src=src, group=self.pg)
        return box[0]

    # -------------------------------------------------------------------- resume

    def resume(self, model, optimizer, scheduler, train_state) -> Optional[int]:
        """Load what the config asks for; returns the step training continues from.

        Full resume: the checkpoint's step. Weights only: 0 (fresh optimizer, schedule and train
        state). Nothing loaded: None. Prints the decision on rank 0. Collective.
        """
        payload = None
        if self.rank == 0:
            try:
                plan = plan_resume(self.cfg, self.dir)
                problems = [] if plan.kind == "fresh" else incompatibilities(
                    self.info, plan.found.manifest, weights_only=plan.kind == "weights")
                if problems:
                    raise _refusal(plan, problems)
                payload = ("ok", plan)
            except ConfigError as exc:
                payload = ("error", (exc.key, exc.problem, exc.allowed))
            except Exception as exc:  # e.g. an unreadable directory: fail every rank, not just 0
                payload = ("failed", f"{type(exc).__name__}: {exc}")
        payload = self._broadcast(payload)
        if payload[0] == "error":
            raise ConfigError(*payload[1])
        if payload[0] == "failed":
            raise CheckpointError(f"cannot decide what to resume from {self.dir}: {payload[1]}")
        plan: ResumePlan = payload[1]
        if self.rank == 0:
            for note in plan.notes:
                _print(note)
            _print(plan.line)
            if plan.found is not None:
                changes = config_changes(self.info, plan.found.manifest)
                if changes:
                    _print(f"config changes since step {plan.step} (allowed): " + "; ".join(changes))
        if plan.kind == "fresh":
            return None
        path = plan.found.path
        try:
            if plan.kind == "weights":
                self._load_weights(model, path)
                result = 0
            else:
                result = self._load_full(plan, model, optimizer, scheduler, train_state)
        except (ConfigError, CheckpointError):
            raise
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise CheckpointError(f"cannot load {path}: {type(exc).__name__}: {first}") from exc
        self.resumed_path = path
        if plan.own and plan.kind == "resume":
            self._have_steps.add(plan.step)
        return result

    def _load_full(self, plan: ResumePlan, model, optimizer, scheduler, train_state) -> int:
        import torch
        import torch.distributed.checkpoint as dcp

        path = plan.found.path
        # Hyper-parameters come from the config; counters ("step": TE FusedAdam keeps Adam's step
        # count in the param group) come from the checkpoint.
        fresh_hparams = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr", "step")}
                         for g in optimizer.param_groups] if optimizer is not None else []
        state = self.engine.state_dict(model, optimizer)
        dcp.load(state, checkpoint_id=str(path), process_group=self.pg)
        self.engine.load_state_dict(model, optimizer, state)

        trainer = json.loads((path / TRAINER).read_text())
        notes = []
        if optimizer is not None:
            notes += self._keep_config_hparams(optimizer, fresh_hparams)
        if scheduler is not None:
            sched_state = trainer.get("scheduler")
            if sched_state is None and trainer.get("scheduler_file"):
                sched_state = torch.load(path / trainer["scheduler_file"], weights_only=False)
            if sched_state is not None:
                notes += self._load_scheduler(scheduler, optimizer, sched_state)
        if train_state is not None and trainer.get("train_state") is not None:
            train_state.load_state_dict(trainer["train_state"])
        self._load_rng(path, int(trainer.get("step", plan.step)))
        old_ws = plan.found.manifest.get("world_size")
        if isinstance(old_ws, int) and old_ws < self.world_size:
            notes.append(f"ranks {old_ws}..{self.world_size - 1} have no saved RNG state: seeded from "
                         "(train.seed, rank, step)")
        if self.rank == 0 and notes:
            _print("; ".join(notes))
        return int(trainer.get("step", plan.step))

    @staticmethod
    def _keep_config_hparams(optimizer, fresh: List[dict]) -> List[str]:
        """The config's optimizer hyper-parameters win over the loaded param groups."""
        notes = []
        if len(fresh) != len(optimizer.param_groups):
            return notes
        for i, (f, g) in enumerate(zip(fresh, optimizer.param_groups)):
            for k, v in f.items():
                if k in g and _hp(g[k]) != _hp(v):
                    notes.append(f"optimizer group {i} {k}: {_hp(g[k])} in the checkpoint -> {_hp(v)} from the config")
                    g[k] = v
        return notes

    @staticmethod
    def _load_scheduler(scheduler, optimizer, sched_state: dict) -> List[str]:
        from .optim import set_lr

        notes = []
        # As floats: under capturable FusedAdam the LRs (and so the base LRs) are device tensors.
        fresh_base = [float(b) for b in getattr(scheduler, "base_lrs", []) or []]
        scheduler.load_state_dict(sched_state)
        if not fresh_base or optimizer is None:
            return notes
        old_base = [float(b) for b in scheduler.base_lrs]
        if old_base != fresh_base:
            notes.append(f"base LR {old_base} in the checkpoint -> {fresh_base} from the config")
            scheduler.base_lrs = fresh_base
            for g, b in zip(optimizer.param_groups, fresh_base):
                g["initial_lr"] = b
        lambdas = getattr(scheduler, "lr_lambdas", None)
        if lambdas is not None and all(callable(f) for f in lambdas):
            # LambdaLR: recompute from (possibly new) base LR and schedule at the restored step;
            # identical to the saved LR when nothing changed.
            lrs = [b * f(scheduler.last_epoch) for f, b in zip(lambdas, map(float, scheduler.base_lrs))]
            for g, lr in zip(optimizer.param_groups, lrs):
                set_lr(g, lr)
            scheduler._last_lr = list(lrs)
        elif old_base != fresh_base:
            notes.append(f"({type(scheduler).__name__}: the new base LR applies from the next schedule step)")
        return notes

    def _load_rng(self, path: Path, step: int) -> None:
        import random

        import numpy as np
        import torch

        f = path / f"extra_rank{self.rank}.pt"
        if f.is_file():
            extra = torch.load(f, weights_only=True)
            rng = extra.get("rng", {})
            torch.set_rng_state(rng["torch"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
            if "python" in rng:
                v, st, g = rng["python"]
                random.setstate((v, tuple(st), g))
            if "numpy" in rng:
                name, keys, pos, has_gauss, gauss = rng["numpy"]
                np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
            return
        seed = fallback_seed(self.info.get("seed", 0) or 0, self.rank, step)
        torch.manual_seed(seed)  # seeds CUDA too
        random.seed(seed)
        np.random.seed(seed % (2**32))

    def _load_weights(self, model, path: Path) -> None:
        """Model weights only, matched by name after stripping wrapper prefixes (any engine)."""
        import torch
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader

        from .engines.base import strip_prefixes

        md = FileSystemReader(str(path)).read_metadata()
        by_name = saved_model_keys(md, path=path, key="checkpoint.load_path")
        ours = self.engine.state_dict(model, None)["model"]
        request, missing, saved_of = {}, [], {}
        for k, v in ours.items():
            name = strip_prefixes(k)
            if name in by_name:
                saved_of[k] = by_name[name]
                request[saved_of[k]] = v
            elif isinstance(v, torch.Tensor):
                missing.append(name)
        if missing:
            raise ConfigError("checkpoint.load_path", f"{path} has no weights for {', '.join(missing[:4])}"
                              + (f" (+{len(missing) - 4} more)" if len(missing) > 4 else ""))
        dcp.load({"model": request}, checkpoint_id=str(path), process_group=self.pg)
        loaded = {k: request[saved] for k, saved in saved_of.items()}
        self.engine.load_state_dict(model, None, {"model": loaded})

    # -------------------------------------------------------------------- save

    def _wants(self, step: int, final: bool, force: bool) -> bool:
        if force or (final and bool(_get(self.cfg, "save_final", True))):
            return True
        interval = int(_get(self.cfg, "interval", 0) or 0)
        return interval > 0 and step > 0 and step % interval == 0

    def maybe_save(self, step: int, model, optimizer, scheduler, train_state, *, final: bool = False,
                   force: bool = False) -> float:
        """Save if this step asks for it; returns the seconds training was blocked. Collective:
        call it on every rank with the same arguments (at every step is fine and polls async saves)."""
        t0 = time.perf_counter()
        if self._pending is not None:
            self._poll()
        if self._wants(step, final, force) and step not in self._have_steps:
            if self._pending is not None:
                self._finish_pending()
            use_async = self._async_pg is not None or (bool(_get(self.cfg, "async_save", False))
                                                       and not self._dist)
            self._save(step, model, optimizer, scheduler, train_state,
                       use_async=use_async and not (final or force))
        blocked = time.perf_counter() - t0
        self.last_blocked_seconds = blocked
        return blocked

    def wait(self) -> None:
        """Finish and commit an in-flight async save. Collective."""
        if self._pending is not None:
            self._finish_pending()

    def _save(self, step, model, optimizer, scheduler, train_state, *, use_async: bool) -> None:
        import torch.distributed.checkpoint as dcp

        tmp = self.dir / (step_name(step) + TMP_SUFFIX)
        started = time.perf_counter()
        pending = {"step": step, "tmp": tmp, "started": started, "future": None, "error": None,
                   "done_at": None, "async": False, "train_state": None}
        self._have_steps.add(step)
        # Collective first (Megatron-FSDP's state_dict is one), then this rank's own files.
        state = self.engine.state_dict(model, optimizer)
        error = None
        try:
            tmp.mkdir(parents=True, exist_ok=True)
            pending["train_state"] = self._write_extras(tmp, step, scheduler, train_state)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        # Every rank must enter DCP's collectives, or none: agree on the local writes first.
        failed = [(r, e) for r, e in enumerate(self._gather(error)) if e]
        if failed:
            pending["error"] = failed
            pending["done_at"] = time.perf_counter()
            self._commit(pending)  # raises
        try:
            if use_async:
                stager = self._stager()
                try:
                    resp = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._async_pg,
                                          async_stager=stager)
                except Exception as exc:
                    if stager is None:
                        raise
                    # Staging happens before the writer starts: retry with torch's own staging.
                    self._staging = False
                    print(f"checkpoint: warning: reusable staging buffers failed ({type(exc).__name__}: "
                          f"{exc}); using torch's default staging", file=sys.stderr, flush=True)
                    resp = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self._async_pg)
                future = getattr(resp, "upload_completion", resp)
                pending["future"], pending["async"] = future, True
                future.add_done_callback(lambda _f, p=pending: p.__setitem__("done_at", time.perf_counter()))
                self._pending = pending
                return
            dcp.save(state, checkpoint_id=str(tmp), process_group=self.pg)
        except Exception as exc:  # DCP raises on every rank when any rank's write failed
            pending["error"] = f"{type(exc).__name__}: {exc}"
        pending["done_at"] = time.perf_counter()
        self._commit(pending)

    def _stager(self):
        """One stager for the run: it keeps its CPU staging buffers and refills them at each save
        (pinned when CUDA is up), instead of allocating the whole state again every time."""
        if self._staging is None:
            import torch

            if tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2]) < (2, 13):
                self._staging = False  # tested on torch 2.13; torch 2.11's stager failed on reuse
                return None
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
            self._staging = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                         use_async_staging=False, use_non_blocking_copy=cuda))
        return self._staging or None

    def _poll(self) -> None:
        p = self._pending
        done = p["future"].done()
        if all(self._gather(done)):
            self._finish_pending()

    def _finish_pending(self) -> None:
        p, self._pending = self._pending, None
        try:
            p["future"].result()
        except Exception as exc:
            p["error"] = p["error"] or f"{type(exc).__name__}: {exc}"
        if p["done_at"] is None:
            p["done_at"] = time.perf_counter()
        self._commit(p)

    def _write_extras(self, tmp: Path, step: int, scheduler, train_state) -> Any:
        """This rank's RNG file; on rank 0 also trainer.json (and scheduler.pt). Returns the train
        state as written to trainer.json (None off rank 0), for the manifest."""
        import random

        import numpy as np
        import torch

        rng: Dict[str, Any] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state()
        v, st, g = random.getstate()
        rng["python"] = (v, list(st), g)
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        rng["numpy"] = (name, keys.tolist(), int(pos), int(has_gauss), float(gauss))
        extra = {"rank": self.rank, "world_size": self.world_size, "step": step, "rng": rng}
        write_atomic(tmp / f"extra_rank{self.rank}.pt", lambda f: torch.save(extra, f))
        if self.rank != 0:
            return None
        ts = train_state.state_dict() if train_state is not None else None
        trainer: Dict[str, Any] = {"step": step, "train_state": _plain(ts)}
        if isinstance(ts, dict):
            for k in ("tokens_seen", "consumed_samples"):
                if k in ts:
                    trainer[k] = ts[k]
        if scheduler is not None:
            sd = scheduler.state_dict()
            if _jsonable(sd):
                trainer["scheduler"] = sd
            else:
                write_atomic(tmp / SCHEDULER_FILE, lambda f: torch.save(sd, f))
                trainer["scheduler"] = None
                trainer["scheduler_file"] = SCHEDULER_FILE
        write_atomic(tmp / TRAINER, lambda f: f.write(json.dumps(trainer, indent=1).encode()))
        return trainer["train_state"]

    def _commit(self, p: dict) -> None:
        """Agree that every rank wrote its part, then rank 0 commits; all ranks return after it."""
        step, tmp = p["step"], p["tmp"]
        if isinstance(p["error"], list):  # already agreed (local writes failed)
            failed = p["error"]
        else:
            failed = [(r, e) for r, e in enumerate(self._gather(p["error"])) if e]
        if not failed:
            commit_error = None
            if self.rank == 0:
                try:
                    self._commit_rank0(p)
                except Exception as exc:
                    commit_error = f"commit: {type(exc).__name__}: {exc}"
            failed = [(r, e) for r, e in enumerate(self._gather(commit_error)) if e]
        if failed:
            self._have_steps.discard(step)
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            prev = [step_name(s) for s in committed_steps(self.dir)]
            why = "; ".join(f"rank {r}: {e}" for r, e in failed[:4])
            raise CheckpointError(f"checkpoint save of step {step} failed ({why}); the committed "
                                  f"checkpoints are intact: {', '.join(prev) or 'none'}")
        self.last_save_seconds = p["done_at"] - p["started"]

    def _commit_rank0(self, p: dict) -> None:
        step, tmp = p["step"], p["tmp"]
        final = self.dir / step_name(step)
        manifest = {
            "format": FORMAT,
            "step": step,
            "config_hash": self.info.get("config_hash"),
            "model": self.info.get("model"),
            "mesh": self.info.get("mesh"),
            "engine": self.info.get("engine"),
            "world_size": self.world_size,
            "versions": self._versions(),
            "seed": self.info.get("seed"),
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "saved_at_unix": time.time(),
            "save_seconds": round(p["done_at"] - p["started"], 4),
            "async": p["async"],
            "train_state": p["train_state"],
            "resumed_from": str(self.resumed_path) if self.resumed_path else None,
            "files": _list_files(tmp),
        }
        if self.info.get("config") is not None:
            manifest["config"] = self.info["config"]
        body = json.dumps(manifest, indent=1, default=str).encode()
        write_atomic(tmp / MANIFEST, lambda f: f.write(body))
        old = None
        if final.exists():  # a step_<N> of an abandoned timeline: replaced only now
            old = self.dir / (final.name + ".old" + TMP_SUFFIX)
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
        try:
            os.replace(tmp, final)
        except OSError:
            if old is not None:
                os.replace(old, final)
            raise
        _fsync_dir(self.dir)
        # Committed. What follows is housekeeping: its failures warn, they do not fail the save.
        try:
            write_atomic(self.dir / LATEST, lambda f: f.write((final.name + "\n").encode()))
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            size = sum(f["bytes"] for f in manifest["files"])
            _print(f"checkpoint {final.name} committed ({size / 1e6:.1f} MB, {manifest['save_seconds']:.2f} s"
                   f"{', async' if p['async'] else ''})")
            self._remove_superseded(step)
            self._prune()
        except OSError as exc:
            print(f"checkpoint: warning: {final.name} is committed but housekeeping failed: {exc}",
                  file=sys.stderr, flush=True)

    def _versions(self) -> dict:
        # Workers pass collect_versions(); it always sets mfsdp-launch, but torch is None for a
        # torch without package metadata (a source build).
        v = dict(self.info.get("versions") or collect_versions())
        if not v.get("torch"):
            import torch

            v["torch"] = torch.__version__
        return v

    def _remove_superseded(self, step: int) -> None:
        later = [(s, p) for s, p in list_step_dirs(self.dir) if s > step]
        for s, p in later:
            shutil.rmtree(p, ignore_errors=True)
        if later:
            _print(f"removed {', '.join(p.name for _, p in later)}: later steps of a timeline this run "
                   f"replaced (it continued from an earlier step)")

    def _prune(self) -> None:
        entries = [(s, p, inspect_checkpoint(p)[1] is None) for s, p in list_step_dirs(self.dir)]
        protect = [self.resumed_path] if self.resumed_path else []
        for p in prune_plan(entries, int(_get(self.cfg, "keep_last", 3) or 1), protect):
            shutil.rmtree(p, ignore_errors=True)


def _hp(v):
    """Comparable form of an optimizer hyper-parameter (tensors -> floats, tuples -> lists)."""
    if hasattr(v, "item") and hasattr(v, "numel") and v.numel() == 1:
        return v.item()
    return _plain(v)
