"""Small-model MFU bench (issue 16, goal 3: 125M-class gpt and te_gpt >= 25 % MFU on 1 and 2 GPUs).

The shipped recipes run the 125M models at micro-batch 4, seq 2048 and are launch-bound (5-14 %
MFU). This matrix measures what lifts them: a larger micro-batch, torch.compile, and full-iteration
CUDA graphs (Megatron-FSDP + TE's capturable FusedAdam, so TE must be installed), each on 1 and 2
GPUs. Every entry is a real `python -m mfsdp_launch` run (scripts/bench_peers.run_ours: the medians
of metrics.jsonl after the first row, as scripts/bench.py computes them). Rows merge into
bench/results.json and are also written to $OUT/small_rows.json; on this machine
`python3 scripts/bench_peers.py --merge .../small_rows.json` merges a device call's rows and renders.

  python3 scripts/bench_small.py --dry                      # every command; runs nothing
  python3 scripts/bench_small.py --world 1 --model gpt      # a slice that fits one device call
  python3 scripts/bench_small.py --only small_mfsdp_gpt_125m_mbs16_graph_g2
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402
import bench_peers  # noqa: E402

GROUP = "small"
ROWS = "small_rows.json"
SMALL = dict(preset="125m", seq=2048, precision="bf16", engine="megatron_fsdp")
VARIANTS = {
    "eager": [],
    "compile": ["train.compile=true"],
    # Full-iteration CUDA graphs: validation's rules (planner/validate.py _check_cuda_graph).
    "graph": ["train.cuda_graph=full_iteration", "optim.impl=te_fused"],
}


def matrix() -> List[dict]:
    out = []
    for world in (1, 2):
        for model in ("gpt", "te_gpt"):
            for mbs in (4, 16):
                for variant, extra in VARIANTS.items():
                    name = f"small_mfsdp_{model}_125m_mbs{mbs}_{variant}_g{world}"
                    out.append(dict(SMALL, name=name, group=GROUP, kind="launcher", model=model, mbs=mbs,
                                    world=world, variant=variant, extra=list(extra)))
    return out


def select(entries: List[dict], a) -> List[dict]:
    keep = [e for e in entries if (not a.world or e["world"] in a.world) and (not a.model or e["model"] in a.model)
            and (not a.variant or e["variant"] in a.variant)]
    return [e for e in keep if not a.only or e["name"] in a.only]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, action="append", default=[], help="1 and/or 2 GPUs")
    ap.add_argument("--model", action="append", default=[], help="gpt | te_gpt")
    ap.add_argument("--variant", action="append", default=[], help=" | ".join(VARIANTS))
    ap.add_argument("--only", action="append", default=[], help="entry names")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--logs", default=os.environ.get("OUT", str(bench.OUT / "small_logs")))
    ap.add_argument("--dry", action="store_true", help="print the commands; run nothing")
    a = ap.parse_args()
    todo = select(matrix(), a)
    if not todo:
        print("bench_small: no entry matches (see --dry for the names)", file=sys.stderr)
        return 2
    logs = Path(a.logs)
    if a.dry:
        for e in todo:
            args = bench_peers.launcher_overrides(e, a.steps, logs / e["name"], e["world"])
            print(f"{e['name']}: {shlex.join([sys.executable, '-m', 'mfsdp_launch', *args])}")
        return 0
    return run(todo, logs, a.steps)


def run(todo: List[dict], logs: Path, steps: int) -> int:
    import torch

    have = torch.cuda.device_count()
    if have == 0:
        print("bench_small: no GPU", file=sys.stderr)
        return 1
    logs.mkdir(parents=True, exist_ok=True)
    res = bench.load_results()
    res["device"] = f"{have}x {torch.cuda.get_device_name(0)}"
    rows: Dict[str, dict] = {}
    with open(logs / "small.log", "a") as log:
        for e in todo:
            if e["world"] > have:
                print(f"{e['name']}: skipped ({e['world']} GPUs wanted, {have} here)", flush=True)
                continue
            row = bench_peers.run_ours(e, steps, logs, log, world=e["world"], group=GROUP)
            row["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
            res["runs"][row["name"]] = rows[row["name"]] = row
            bench.save_results(res)
            (logs / ROWS).write_text(json.dumps({"device": res["device"], "runs": rows}, indent=1, sort_keys=True))
            got = (f"{row['tokens_per_s_per_gpu']:,.0f} tok/s/GPU, MFU {100 * (row.get('mfu') or 0):.1f}%"
                   if row.get("ok") else "FAILED " + str(row.get("error", ""))[-300:])
            print(f"{row['name']}: {got} ({row.get('wall_s', '?')} s)", flush=True)
    bench.render(res)  # with the peers' and these notes (scripts/bench_report.py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
