"""A model built on the meta device, for checks before spawning: parameter and module names
(model.freeze and fp8.skip globs) without allocating a weight."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import warnings
from typing import List, Optional, Tuple


def meta_names(model_cfg, seq_len: int) -> Tuple[List[str], List[str]]:
    """(parameter names, module names) of the model built on the meta device."""
    import torch

    from . import build_model_spec

    spec = build_model_spec(model_cfg, seq_len)
    # Only the names are needed; a model's construction warnings would break the one-line error.
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = spec.build()
    return [n for n, _ in model.named_parameters()], [n for n, _ in model.named_modules() if n]


def meta_modules(model_cfg, seq_len: int) -> dict:
    """models/lora.py's module table of the model built on the meta device."""
    import torch

    from . import build_model_spec
    from .lora import module_table

    spec = build_model_spec(model_cfg, seq_len)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return module_table(spec.build())


def te_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def meta_names_isolated(model_cfg_dict: dict, seq_len: int) -> Optional[Tuple[List[str], List[str]]]:
    """meta_names in a short-lived process: building TE layers may open a CUDA context, which the
    launcher must not hold on GPU 0 for the whole run. None when TE is absent or cannot build here."""
    if not te_installed():
        return None
    code = ("import json, sys\n"
            "from mfsdp_launch.models import section_of\n"
            "from mfsdp_launch.models.meta import meta_names\n"
            "spec = json.loads(sys.argv[1])\n"
            "m = section_of(spec['model']['name'])(**spec['model'])\n"
            "print(json.dumps(meta_names(m, spec['seq_len'])))\n")
    spec = {"model": model_cfg_dict, "seq_len": seq_len}
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True,
                              timeout=300)
        params, modules = json.loads(proc.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError):
        return None
    return params, modules
