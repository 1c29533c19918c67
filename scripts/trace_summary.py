"""Where a profiled step's GPU time goes, read from a chrome trace (torch.profiler's export: ours under
run.dir/profile/, torchtitan's under its dump folder's profiling/traces/): the kernels' time by kind
(GEMM, grouped GEMM, attention, optimizer, copies, ...), the busy share of the traced span (what is
left is the GPU waiting on the host: launch-bound time) and the top kernels. One reader for every
trace, so our step and a peer's are cut the same way.

  python3 scripts/trace_summary.py TRACE.json[.gz] [--steps N] [--top 20] [--label NAME]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

# First match wins: a grouped GEMM is a GEMM, a flash kernel is attention before it is anything else.
KINDS: Sequence[Tuple[str, re.Pattern]] = tuple((k, re.compile(p, re.I)) for k, p in (
    ("communication", r"nccl"),
    ("grouped GEMM", r"group(ed)?_?(gemm|mm)|GroupProblemShape|grouped"),
    ("attention", r"flash|fmha|attention|attn|sdpa|flex"),
    ("GEMM", r"gemm|cutlass|xmma|nvjet|cublas|wgmma|sm90_|sm80_"),
    ("optimizer", r"multi_tensor|adam|fused_adam"),
    ("compiled (triton)", r"^triton_"),
    ("copy / cast", r"memcpy|memset|copy|CatArray|cat_|to_copy"),
    ("norm / softmax / loss", r"norm|softmax|cross_entropy|nll|log_softmax"),
    ("elementwise", r"elementwise|vectorized|unrolled|distribution"),
    ("reduce", r"reduce"),
))
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def load_events(path: Path) -> List[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def gpu_kernels(events: Iterable[dict]) -> List[Tuple[float, float, str]]:
    """(start us, duration us, name) of every GPU-side event."""
    return [(float(e["ts"]), float(e.get("dur", 0.0)), e.get("name", "?")) for e in events
            if e.get("ph") == "X" and e.get("cat") in GPU_CATS]


def busy_time(kernels: Sequence[Tuple[float, float, str]]) -> float:
    """The union of the kernels' intervals: time at least one kernel ran (streams overlap)."""
    busy, end = 0.0, float("-inf")
    for start, dur, _ in sorted(kernels):
        stop = start + dur
        if start >= end:
            busy += dur
        elif stop > end:
            busy += stop - end
        end = max(end, stop)
    return busy


def summarize(kernels: Sequence[Tuple[float, float, str]], steps: int = 1, top: int = 20) -> dict:
    """Per-step figures in ms: the traced span, busy time, kernel time by kind, the top kernels."""
    if not kernels:
        return dict(span_ms=0.0, busy_ms=0.0, kernel_ms=0.0, kinds={}, top=[])
    span = max(s + d for s, d, _ in kernels) - min(s for s, _, _ in kernels)
    by_kind: Dict[str, float] = defaultdict(float)
    by_name: Dict[str, List[float]] = defaultdict(lambda: [0.0, 0])
    for _, dur, name in kernels:
        by_kind[kind_of(name)] += dur
        by_name[name][0] += dur
        by_name[name][1] += 1
    per = 1000.0 * steps  # us -> ms per step
    total = sum(by_kind.values())
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(span_ms=span / per, busy_ms=busy_time(kernels) / per, kernel_ms=total / per,
                kinds={k: v / per for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
                top=[(name, t / per, n / steps, kind_of(name)) for name, (t, n) in ranked])


def render(s: dict, label: str = "") -> str:
    lines = [f"== {label}" if label else "==",
             f"per step: traced span {s['span_ms']:.2f} ms, GPU busy {s['busy_ms']:.2f} ms "
             f"({100 * s['busy_ms'] / s['span_ms'] if s['span_ms'] else 0:.1f} % of the span), "
             f"kernel time {s['kernel_ms']:.2f} ms"]
    for kind, ms in s["kinds"].items():
        lines.append(f"  {kind:<24} {ms:9.2f} ms  {100 * ms / s['kernel_ms']:5.1f} %")
    lines.append("top kernels (ms per step, launches per step, kind):")
    for name, ms, n, kind in s["top"]:
        lines.append(f"  {ms:8.2f} {n:7.1f}  {kind:<22} {name[:110]}")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--steps", type=int, default=1, help="profiled steps in the trace (figures are per step)")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--label", default="")
    a = ap.parse_args(argv)
    path = Path(a.trace)
    if not path.is_file():
        print(f"trace_summary: no trace at {path}", file=sys.stderr)
        return 2
    print(render(summarize(gpu_kernels(load_events(path)), a.steps, a.top), a.label or path.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
