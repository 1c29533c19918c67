"""How long `mfsdp-train --help` and a dry run take, against `python -c "import torch"`.

Target: both under 1.5x the torch import. Usage: python scripts/cli_latency.py [repeats]
"""

import subprocess
import sys
import time


def best_of(cmd, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, capture_output=True)
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    py = sys.executable
    torch_s = best_of([py, "-c", "import torch"], n)
    rows = [
        ("python -c 'import torch'", torch_s),
        ("mfsdp-train --help", best_of([py, "-m", "mfsdp_launch", "--help"], n)),
        ("mfsdp-train +recipe=hfsdp_fp8 launcher.dry_run=true launcher.nproc_per_node=8",
         best_of([py, "-m", "mfsdp_launch", "+recipe=hfsdp_fp8", "launcher.dry_run=true",
                  "launcher.nproc_per_node=8"], n)),
    ]
    print(f"| command (best of {n}) | seconds | x import torch |\n|---|---|---|")
    for name, secs in rows:
        print(f"| `{name}` | {secs:.3f} | {secs / torch_s:.2f} |")
    return 0 if all(s < 1.5 * torch_s for _, s in rows[1:]) else 1


if __name__ == "__main__":
    sys.exit(main())
