"""`mfsdp-export CKPT OUT`: a committed checkpoint's model weights as one plain file.

    python -m mfsdp_launch.tools.export runs/x/checkpoints/step_40 model.safetensors --dtype bf16

CKPT is a step directory, a `checkpoints/` directory or a run directory (the latter two give their
newest intact checkpoint, or `--step N|best`; best: checkpoint.keep_best's lowest validation loss).
The DCP shards are read in this process, without a process group, so
it runs anywhere (no GPU, any world size). Only the model's tensors are kept; wrapper prefixes
("module.", "_orig_mod.", ...) are stripped, so the keys are those of the unwrapped model's
`state_dict()`. Floating-point tensors are cast to --dtype (default: as saved). The format follows
OUT's extension (.safetensors; .pt, .pth, .bin: `torch.save`) or --format, and a --format that
contradicts the extension is refused; the file gets the mode a new file
gets under the umask (0644 under 022), and it and its directory are fsynced. Every file's checksum
is verified first. Bad input, a damaged or unreadable checkpoint: one line on stderr, exit 2.

A LoRA run's checkpoint holds its adapters only (model.peft): `--format peft` writes them as an
adapter directory for `peft.PeftModel`, `--format hf --merge` merges them into their base (the
directory the checkpoint records, or `--base DIR` with the same checksum); models/lora_export.py.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, List, Optional

from ..core import storage
from ..core.atomic_io import atomic_write_path
from ..checkpoint.weights import read_model_state
from ..core.errors import ConfigError
from .tool_cli import OneLineParser, run_tool

if TYPE_CHECKING:
    pass

DTYPES = ("fp32", "bf16", "fp16", "as_saved")
HF_DIR = "hf"  # --format: a Hugging Face directory (config.json + safetensors), models/llama/hf_export.py
PEFT_DIR = "peft"  # --format: a LoRA run's adapter directory for peft.PeftModel (models/lora_export.py)
FORMATS = ("safetensors", "torch", HF_DIR, PEFT_DIR)


def _have_safetensors() -> bool:
    import importlib.util

    return importlib.util.find_spec("safetensors") is not None


# A file's extension says how to read it: the format follows it, and a --format that contradicts it
# is refused (a safetensors file named .pt would fail torch.load).
EXTENSIONS = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}


def format_for(out: str | os.PathLike, fmt: Optional[str]) -> str:
    """The format OUT is written in: --format, else OUT's extension (EXTENSIONS); one line when
    they disagree, or when neither says."""
    if fmt in (HF_DIR, PEFT_DIR):
        return fmt
    ext = Path(str(out)).suffix.lower()
    by_ext = EXTENSIONS.get(ext)
    allowed = ", ".join(f"{e} ({f})" for e, f in EXTENSIONS.items())
    if fmt is None:
        if by_ext is None:
            raise ConfigError("OUT", f"{out}: cannot tell the format from its extension {ext or '(none)'!r}",
                              f"{allowed}, or --format safetensors|torch|hf|peft")
        return by_ext
    if by_ext is not None and by_ext != fmt:
        raise ConfigError("--format", f"{fmt}, but OUT {out} has the extension of a {by_ext} file",
                          f"--format {by_ext}, or an OUT named for {fmt}")
    return fmt


def export(ckpt: str | os.PathLike, out: str | os.PathLike, *, dtype: str = "as_saved",
           fmt: Optional[str] = None, merge: bool = False, base: Optional[str] = None) -> dict:
    """`merge`: a LoRA run's adapters merged into their base (--format hf); `base`: that base's
    directory when it moved from the one the checkpoint records."""
    import torch

    if dtype not in DTYPES:
        raise ConfigError("--dtype", f"unknown dtype {dtype!r}", DTYPES)
    if fmt is not None and fmt not in FORMATS:
        raise ConfigError("--format", f"unknown format {fmt!r}", FORMATS)
    fmt = format_for(out, HF_DIR if merge and fmt is None else fmt)  # --merge writes an HF directory
    if fmt == "safetensors" and not _have_safetensors():
        raise ConfigError("--format", "safetensors is not installed (pip install safetensors)", "torch")
    if merge and fmt != HF_DIR:
        raise ConfigError("--merge", f"merges a LoRA run's adapters into their base for --format hf, not {fmt}",
                          "--format hf --merge, or no --merge")
    if base is not None and not (merge or fmt == PEFT_DIR):
        raise ConfigError("--base", "names a LoRA base for --format hf --merge or --format peft", "no --base")
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    if merge or fmt == PEFT_DIR:
        from ..models.lora_export import export_adapters

        return export_adapters(ckpt, out, merge=merge, base=base, dtype=torch_dtype)
    if fmt == HF_DIR:
        from ..models.llama.hf_export import export_checkpoint

        return export_checkpoint(ckpt, out, dtype=None if dtype == "as_saved" else dtype)
    out = storage.path(out).expanduser().absolute()  # a file, or an object (s3://BUCKET/KEY)
    if out.is_dir():
        raise ConfigError("OUT", f"{out} is a directory; give a file name")
    if not storage.is_remote(out) and not out.parent.is_dir():
        raise ConfigError("OUT", f"{out.parent} does not exist")
    state, found = read_model_state(ckpt)
    target = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    tensors = {}
    for k, t in state.items():
        if target is not None and t.is_floating_point():
            t = t.to(target)
        tensors[k] = t.contiguous()
    if fmt == "safetensors":
        from safetensors.torch import save_file

        meta = {"step": str(found.step), "source": str(found.path)}
        if storage.is_remote(out):  # one PUT of the serialized file
            from safetensors.torch import save

            storage.atomic_write(out, lambda f: f.write(save(tensors, metadata=meta)))
        else:
            # safetensors writes by path only, into a new file (mode 0600) that replaces the path:
            # atomic_write_path fsyncs whatever file is there by name and gives it the umask's mode.
            atomic_write_path(out, lambda tmp: save_file(tensors, tmp, metadata=meta))
    elif storage.is_remote(out):
        storage.atomic_write(out, lambda f: torch.save(tensors, f))
    else:
        atomic_write_path(out, lambda tmp: torch.save(tensors, tmp))
    n_params = sum(t.numel() for t in tensors.values())
    return {"path": str(out), "step": found.step, "source": str(found.path), "tensors": len(tensors),
            "params": n_params, "format": fmt, "bytes": out.stat().st_size}


def main(argv: Optional[List[str]] = None) -> int:
    parser = OneLineParser(
        prog="mfsdp-export",
        description="Write a committed checkpoint's model weights to one safetensors/torch file.")
    parser.add_argument("ckpt", metavar="CKPT_DIR", help="step_<N> directory, checkpoints/ or run directory")
    parser.add_argument("out", metavar="OUT", help="output file")
    parser.add_argument("--step", default=None, metavar="N|best",
                        help="the step to export from a run or checkpoints directory: a number, or best (the "
                             "lowest validation loss, checkpoint.keep_best=val_loss); default: the newest")
    parser.add_argument("--dtype", default="as_saved", choices=DTYPES, help="cast floating tensors (default: as saved)")
    parser.add_argument("--format", default=None, choices=FORMATS,
                        help="default: from OUT's extension (.safetensors, .pt/.pth/.bin: torch); hf: OUT is a Hugging Face "
                             "directory; peft: a LoRA run's adapter directory (peft.PeftModel.from_pretrained)")
    parser.add_argument("--merge", action="store_true",
                        help="with --format hf: a LoRA run's adapters merged into their base (a plain HF model)")
    parser.add_argument("--base", default=None, metavar="DIR",
                        help="the LoRA base's directory, when it is no longer where the checkpoint records it "
                             "(its files must have the recorded checksum)")
    args = parser.parse_args(argv)

    def body() -> int:
        from ..checkpoint.best import resolve_step

        ckpt = args.ckpt if args.step is None else resolve_step(args.ckpt, args.step).path
        info = export(ckpt, args.out, dtype=args.dtype, fmt=args.format, merge=args.merge, base=args.base)
        print(f"mfsdp-export: wrote {info['tensors']} tensors ({info['params']:,} parameters) of step "
              f"{info['step']} to {info['path']} ({info['format']}, {info['bytes'] / 1e6:.1f} MB)")
        return 0

    return run_tool("mfsdp-export", body)


if __name__ == "__main__":
    sys.exit(main())
