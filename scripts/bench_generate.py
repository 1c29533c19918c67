"""mfsdp-generate's decode speed on one GPU (issue 29: the 1.4b gpt, batch 1, greedy, bf16, KV cache).

Trains the model for one step through `mfsdp-train` (engine=fsdp2, one process) so that a real
checkpoint exists, then runs `mfsdp-generate` on it with each `--decoder` (eager, compile: torch.compile
in a CUDA graph, triton: the fused kernels in a CUDA graph, the default on a GPU), each twice, and
prints one JSON object with every tokens/s figure and the commands that produced them.

    python3 scripts/bench_generate.py --run-dir /tmp/gen14 --preset 1.4b --new-tokens 512 > gen.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_variants  # noqa: E402

VARIANT_MAIN = ("import json, sys; sys.path[:0] = [{scripts!r}, {root!r}]; import decode_variants; "
                "decode_variants.apply(json.loads(sys.argv.pop(1))); from mfsdp_launch.tools.generate import main; "
                "sys.exit(main(sys.argv[1:]))").format(scripts=str(Path(__file__).resolve().parent),
                                                       root=str(Path(__file__).resolve().parent.parent))

def run(cmd: list, timeout: float) -> subprocess.CompletedProcess:
    print("$", " ".join(cmd), file=sys.stderr, flush=True)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        sys.exit(f"bench_generate: failed ({out.returncode}): {' '.join(cmd)}\n{out.stderr[-3000:]}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True)
    p.add_argument("--preset", default="1.4b")
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--prompt", default="def main(argv=None):\n    ")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--decoders", default="triton,compile,eager",
                   help="--decoder values; triton+name=value a variant of the fused step (scripts/decode_variants.py)")
    args = p.parse_args(argv)

    train = [sys.executable, "-m", "mfsdp_launch", "model=gpt", f"model.preset={args.preset}", "engine=fsdp2",
             "data=text", f"run.dir={args.run_dir}", "train.steps=1", "train.micro_batch_size=1",
             "train.seq_len=2048", "launcher.nproc_per_node=1", "precision.compute_dtype=bf16",
             "checkpoint.save_final=true", "checkpoint.resume=auto"]
    t0 = time.time()
    run(train, timeout=900)
    result = {"preset": args.preset, "new_tokens": args.new_tokens, "train_cmd": shlex.join(["mfsdp-train", *train[3:]]),
              "train_s": round(time.time() - t0, 1), "rows": []}
    for setting in args.decoders.split(","):
        decoder, changes = decode_variants.parse(setting)
        # A variant runs mfsdp-generate's own main with the fused step's changes applied first.
        launch = ["-c", VARIANT_MAIN, json.dumps(changes)] if changes else ["-m", "mfsdp_launch.tools.generate"]
        gen = [sys.executable, *launch, args.run_dir, "--prompt", args.prompt,
               "--max-new-tokens", str(args.new_tokens), "--ignore-eos", "--dtype", "bf16", "--json",
               "--decoder", decoder]
        for attempt in range(args.repeats):
            row = json.loads(run(gen, timeout=900).stdout.strip().splitlines()[-1])
            result["rows"].append({"decoder": setting, "attempt": attempt, "tokens_per_s": row["tokens_per_s"],
                                   "seconds": row["seconds"], "new_tokens": row["new_tokens"],
                                   "cmd": shlex.join(["mfsdp-generate", *gen[len(launch) + 1:]])})
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
