"""The command torchrun starts on every rank: `python -m mfsdp_launch.rank --config RUN/config.yaml`.

Process guards first (`stopping.install_process_guards`: die with torchrun, turn stop signals
into a graceful stop request from the first instant), then the worker.
"""

from __future__ import annotations

import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    from .stopping import install_process_guards, run_dir_from

    argv = list(sys.argv[1:] if argv is None else argv)
    install_process_guards(run_dir_from(argv))
    from .worker import main as worker_main

    return worker_main(argv)


if __name__ == "__main__":
    from .worker import leave

    leave(main())
