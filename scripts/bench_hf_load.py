"""Host memory per rank while `model=hf model.pretrained=true` loads a Hugging Face checkpoint.

Writes a random-weight Llama checkpoint with a gpt preset's dims (bf16 safetensors, sharded with
an index, as `save_pretrained` would), then trains a few steps from it through the launcher on
every engine asked for, and prints the loader's line: each rank's peak RSS during the load, which
must stay near the rank's shard plus one slice, not the checkpoint's size.

  python3 scripts/bench_hf_load.py --preset 8b --engine megatron_fsdp --engine fsdp2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def write_checkpoint(out: Path, preset: str) -> float:
    """A random bf16 LlamaForCausalLM directory (config.json + sharded safetensors); its GiB."""
    import torch

    from mfsdp_launch.models.llama.hf_config import llama_config
    from mfsdp_launch.models.llama.hf_export import write_hf_dir
    from mfsdp_launch.models.llama.hf_keys import hf_shapes
    from mfsdp_launch.models.llama.dims import resolve_gpt_dims
    from types import SimpleNamespace

    dims = resolve_gpt_dims(SimpleNamespace(preset=preset, norm_eps=1e-5, rope_theta=500000.0))
    shapes = hf_shapes(dims)
    nbytes = {k: 2 * int(torch.Size(s).numel()) for k, s in shapes.items()}
    gen = torch.Generator("cuda" if torch.cuda.is_available() else "cpu").manual_seed(0)

    def make(name: str) -> torch.Tensor:
        t = torch.empty(shapes[name], dtype=torch.bfloat16, device=gen.device)
        if name.endswith("norm.weight"):
            return t.fill_(1.0).cpu()
        return t.normal_(0.0, 0.02, generator=gen).cpu()

    out.parent.mkdir(parents=True, exist_ok=True)
    write_hf_dir(out, nbytes, make, config=llama_config(dims, dtype="bfloat16"))
    return sum(nbytes.values()) / 2**30


def run(engine: str, hf_dir: Path, run_dir: Path, nproc: int, steps: int, backend: str) -> str:
    gpu = backend == "nccl"  # gloo: a quick try on a CPU, fp32 and short sequences
    cmd = [sys.executable, "-m", "mfsdp_launch", "model=hf", f"model.path={hf_dir}", "model.pretrained=true",
           "model.init_on_meta=true", f"engine={engine}", f"engine.backend={backend}", f"launcher.nproc_per_node={nproc}",
           f"precision.compute_dtype={'bf16' if gpu else 'fp32'}", f"train.seq_len={2048 if gpu else 128}", "train.micro_batch_size=1", f"train.steps={steps}",
           "train.log_interval=1", "checkpoint.save_final=false", f"run.dir={run_dir}"]
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    proc = subprocess.run(["timeout", "-k", "10", "400", *cmd], capture_output=True, text=True, cwd=ROOT)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines()
             if "model.pretrained:" in ln or "step" in ln.lower() and "loss" in ln.lower() or "error" in ln.lower()]
    print("\n".join(lines[-12:]), flush=True)
    print(f"{engine}: exit {proc.returncode} in {time.time() - t0:.0f} s", flush=True)
    if proc.returncode:
        print((proc.stdout + proc.stderr)[-3000:])
    return next((ln for ln in lines if "model.pretrained:" in ln), "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="8b")
    ap.add_argument("--engine", action="append", default=[])
    ap.add_argument("--dir", default="/tmp/hf_load_bench")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--backend", default="nccl", help="gloo to try it on a CPU")
    args = ap.parse_args()
    base = Path(args.dir)
    hf_dir = base / f"llama_{args.preset}"
    if not (hf_dir / "config.json").exists():
        t0 = time.time()
        gib = write_checkpoint(hf_dir, args.preset)
        print(f"wrote a {gib:.1f} GiB {args.preset} checkpoint in {time.time() - t0:.0f} s: "
              f"{sorted(p.name for p in hf_dir.iterdir())}", flush=True)
    results = {e: run(e, hf_dir, base / f"run_{e}", args.nproc, args.steps, args.backend) for e in args.engine or ["megatron_fsdp"]}
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
