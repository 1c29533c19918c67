"""Where each sample goes: the global sample index, the same for every data-parallel layout.

Every training sample has a *global sample index* ``g``: one counter over all data-parallel
(DP) ranks, micro-batches and optimizer steps. Sample ``g`` is a pure function of ``(seed, g)``
(and the corpus), so there is no loader state to checkpoint:

* the loader is deterministic in (seed, step, DP rank);
* a resume continues exactly where it stopped, from ``consumed_samples = step * samples_per_step``;
* a resume at another DP size recomputes the starts from the same global counter.

Layout (``mbs`` = micro-batch size, ``ga`` = gradient-accumulation steps, ``dp`` = DP size)::

    start(step s, micro m, rank r) = (s * ga + m) * (mbs * dp) + r * mbs

so micro-batch ``m`` of rank ``r`` holds samples ``start .. start + mbs - 1``. The samples of
optimizer step ``s`` are exactly ``[s * S, (s + 1) * S)`` with ``S = samples_per_step =
mbs * ga * dp``, whatever the split into ranks and micro-batches. If the global batch size
changes at a resume, pass ``base_step``/``base_samples`` (the step and ``consumed_samples`` of
the checkpoint) to :func:`microbatch_start` so the counter continues from the samples consumed.

Validation batches use the same layout over the validation split with ``ga = 1``: validation
step ``v`` of rank ``r`` reads val samples ``v * mbs * dp + r * mbs ...``, the same ones at
every validation, so the curve compares like with like.
"""

from __future__ import annotations

import numpy as np


def samples_per_step(micro_batch_size: int, grad_accum_steps: int, dp_size: int) -> int:
    """Global samples consumed by one optimizer step: ``mbs * grad_accum * dp_size``."""
    for name, v in (("micro_batch_size", micro_batch_size), ("grad_accum_steps", grad_accum_steps),
                    ("dp_size", dp_size)):
        if int(v) < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    return int(micro_batch_size) * int(grad_accum_steps) * int(dp_size)


def microbatch_start(step: int, micro: int, *, micro_batch_size: int, grad_accum_steps: int, dp_rank: int,
                     dp_size: int, base_step: int = 0, base_samples: int = 0) -> int:
    """Global sample index of rank ``dp_rank``'s first sample in micro-batch ``micro`` of step ``step``.

    ``start = base_samples + ((step - base_step) * ga + micro) * (mbs * dp) + dp_rank * mbs``.
    """
    samples_per_step(micro_batch_size, grad_accum_steps, dp_size)  # validates the sizes
    if not 0 <= micro < grad_accum_steps:
        raise ValueError(f"micro must be in [0, {grad_accum_steps}), got {micro}")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
    if step < base_step:
        raise ValueError(f"step {step} is before base_step {base_step}")
    per_micro = micro_batch_size * dp_size
    return (int(base_samples) + ((step - base_step) * grad_accum_steps + micro) * per_micro
            + dp_rank * micro_batch_size)


def val_batch_start(val_step: int, *, micro_batch_size: int, dp_rank: int, dp_size: int) -> int:
    """First validation sample of rank ``dp_rank`` in validation step ``val_step``."""
    return microbatch_start(val_step, 0, micro_batch_size=micro_batch_size, grad_accum_steps=1,
                            dp_rank=dp_rank, dp_size=dp_size)


def sample_rng(seed: int, g: int) -> np.random.Generator:
    # SeedSequence wants non-negative entropy; fold negative seeds into uint64.
    return np.random.default_rng([int(seed) & 0xFFFFFFFFFFFFFFFF, int(g)])
