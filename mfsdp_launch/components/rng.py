"""Random number generators of a process: one seeding function, and their state as an object that
saves itself (a checkpoint stores it per rank).

numpy and torch are imported inside the functions: importing this module imports nothing heavy.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Dict


def seed_all(seed: int) -> None:
    """Seed torch (CPU and every CUDA device), Python's `random` and numpy's global generator."""
    import numpy as np
    import torch

    torch.manual_seed(seed)  # seeds CUDA too
    random.seed(seed)
    np.random.seed(seed % 2**32)


def fallback_seed(seed: int, rank: int, step: int) -> int:
    """Seed for a rank that has no saved RNG state (a resume at a larger world size)."""
    h = hashlib.sha256(f"mfsdp-rng:{int(seed)}:{int(rank)}:{int(step)}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


class RNGState:
    """The torch CPU, CUDA (when initialised), Python and numpy generators of this process."""

    def state_dict(self) -> Dict[str, Any]:
        import numpy as np
        import torch

        rng: Dict[str, Any] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state()
        v, st, g = random.getstate()
        rng["python"] = (v, list(st), g)
        name, keys, pos, has_gauss, gauss = np.random.get_state()
        rng["numpy"] = (name, keys.tolist(), int(pos), int(has_gauss), float(gauss))
        return rng

    def load_state_dict(self, rng: Dict[str, Any]) -> None:
        import numpy as np
        import torch

        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
        if "python" in rng:
            v, st, g = rng["python"]
            random.setstate((v, tuple(st), g))
        if "numpy" in rng:
            name, keys, pos, has_gauss, gauss = rng["numpy"]
            np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
