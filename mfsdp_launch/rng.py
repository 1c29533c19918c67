"""Random state: one seeding function for every generator the run uses."""

from __future__ import annotations

import random


def seed_all(seed: int) -> None:
    """Seed torch (CPU and CUDA), Python and NumPy."""
    import numpy as np
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)
