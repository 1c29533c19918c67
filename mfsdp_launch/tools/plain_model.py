"""A run's committed checkpoint, or a Hugging Face directory, as a plain (unsharded) model on one
device: what `mfsdp-generate` and `mfsdp-eval` run.

A run directory gives its newest intact checkpoint (or `step`); the weights are read in this
process without a process group (checkpoint/weights.py, checksums verified), and the model is
built from the run's config recorded in the checkpoint manifest, so it runs on any machine at
any world size. An HF directory (config.json beside safetensors, no checkpoints) loads through
transformers. Bad input is a ConfigError under `key`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from ..checkpoint import CHECKPOINTS, MANIFEST, committed_steps, require_step, resolve_checkpoint
from ..core.errors import ConfigError

if TYPE_CHECKING:
    import torch

DTYPES = ("auto", "fp32", "bf16", "fp16")
HF_CONFIG = "config.json"


@dataclass
class PlainModel:
    model: Any  # torch.nn.Module, in eval mode
    family: str  # model.name of the run ("gpt", "hf", ...), or "hf" for an HF directory
    source: Path  # the step directory or the HF directory
    config: Dict[str, Any] = field(default_factory=dict)  # the run's config ({} for an HF directory)
    step: Optional[int] = None
    run_dir: Optional[Path] = None  # the run directory holding the checkpoint, when there is one
    spec: Any = None  # the family's ModelSpec (its loss, vocab), for a run's checkpoint

    @property
    def hf_dir(self) -> Optional[Path]:
        return self.source if not self.config else None

    @property
    def device(self) -> "torch.device":
        return next(self.model.parameters()).device


def pick_device(name: str, key: str = "--device") -> "torch.device":
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(key, f"unknown device {name!r}", "auto|cpu|cuda|cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(key, f"{name}, but this machine (or torch build) has no CUDA", "auto|cpu")
    if device.type == "cuda" and device.index is not None:
        count = torch.cuda.device_count()
        if device.index >= count:
            raise ConfigError(key, f"{name}, but this machine has {count} GPU(s)", f"cuda:0..cuda:{count - 1}")
        # Triton launches on the current device, and CUDA graphs capture on its stream: make it this one.
        torch.cuda.set_device(device)
    return device


def pick_dtype(name: str, device: "torch.device", key: str = "--dtype") -> "torch.dtype":
    import torch

    if name not in DTYPES:
        raise ConfigError(key, f"unknown dtype {name!r}", DTYPES)
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def is_hf_dir(path: str | os.PathLike) -> bool:
    p = Path(path).expanduser()
    return (p / HF_CONFIG).is_file() and not (p / CHECKPOINTS).is_dir() and not (p / MANIFEST).is_file()


def checkpoint_steps(run: str | os.PathLike, key: str = "RUN") -> List[int]:
    """The intact committed steps of a run (or checkpoints) directory, ascending; refused when none."""
    found = resolve_checkpoint(run, key=key)  # a refusal naming what is there, if nothing is
    root = found.path.parent
    return committed_steps(root) if root.name == CHECKPOINTS else [found.step]


def step_dir(run: str | os.PathLike, step: Optional[int], key: str = "RUN") -> Path:
    """The step directory to load: `step` of the run, or its newest intact checkpoint."""
    if step is None:
        return resolve_checkpoint(run, key=key).path
    p = Path(run).expanduser().absolute()
    root = p / CHECKPOINTS if (p / CHECKPOINTS).is_dir() else p
    if not root.is_dir():
        raise ConfigError(key, f"{p} does not exist")
    return require_step(root, step, key="--step").path


def load(run: str | os.PathLike, *, step: Optional[int] = None, device: "torch.device",
         dtype: "torch.dtype", key: str = "RUN", prog: str = "mfsdp-generate") -> PlainModel:
    """The model of `run` (a run, checkpoints or step directory, or an HF directory) on `device`."""
    if is_hf_dir(run):
        if step is not None:
            raise ConfigError("--step", f"{run} is a Hugging Face directory, which has no steps")
        return _load_hf_dir(Path(run).expanduser().absolute(), device, dtype, key)
    from ..checkpoint.weights import read_model_state

    state, found = read_model_state(step_dir(run, step, key), prog=prog)
    from ..checkpoint.adapters import of

    if of(found.manifest):
        raise ConfigError(key, f"{found.path} holds LoRA adapters only (model.peft), not a model",
                          "a merged model: mfsdp-export RUN OUT_DIR --format hf --merge, then give OUT_DIR")
    config = found.manifest.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise ConfigError(key, f"{found.path}'s manifest records no run config, so the model cannot be built")
    run_dir = found.path.parent.parent if found.path.parent.name == CHECKPOINTS else None
    out = PlainModel(None, str(config["model"].get("name")), found.path, config, found.step, run_dir)
    out.model, out.spec = _build(out, state, device, dtype, key)
    return out


def _build(pm: PlainModel, state: Dict[str, "torch.Tensor"], device, dtype, key: str):
    import torch

    from ..models import build_model_spec, section_from

    seq_len = int((pm.config.get("train") or {}).get("seq_len", 1))
    try:
        spec = build_model_spec(section_from(pm.config["model"]), seq_len)
        with torch.device(device):
            model = spec.build()
    except ImportError as exc:
        raise ConfigError(key, f"model={pm.family} cannot be built here ({exc})") from None
    if getattr(getattr(model, "config", None), "use_cache", None) is False:
        model.config.use_cache = True  # an HF model trained without its KV cache; generation wants it
    model.to(dtype)
    ours = model.state_dict()
    missing = [k for k in ours if k not in state and not k.endswith("_extra_state")]
    unknown = [k for k in state if k not in ours]
    if missing or unknown:
        raise ConfigError(key, f"{pm.source} does not hold model={pm.family}'s weights as configured "
                          f"(missing {missing[:3]}, unknown {unknown[:3]})")
    model.load_state_dict({k: v for k, v in state.items() if k in ours}, strict=False)
    return model.eval(), spec


def _load_hf_dir(path: Path, device, dtype, key: str) -> PlainModel:
    from ..models.hf.model import import_transformers

    transformers = import_transformers(key)
    from packaging.version import Version

    dtype_kw = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    transformers.utils.logging.disable_progress_bar()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), **{dtype_kw: dtype})
    except (OSError, ValueError) as exc:
        raise ConfigError(key, f"{path} does not load as a causal LM ({str(exc).splitlines()[0][:200]})") from None
    return PlainModel(model.to(device).eval(), "hf", path)
