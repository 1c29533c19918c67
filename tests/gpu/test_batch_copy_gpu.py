"""A micro-batch goes to the GPU without waiting for the work already queued there
(rank/runtime.copy_to_device: through pinned memory), so the host stays ahead of the GPU. From
pageable memory CUDA may wait for the stream before the copy; the test prints whether this
machine's driver did, beside the assertion on ours."""

from __future__ import annotations

import pytest

from _harness import require_gpus

pytestmark = [pytest.mark.gpu]


def test_a_batch_copy_returns_while_the_gpu_is_still_busy():
    require_gpus(1)
    import torch

    from mfsdp_launch.rank.runtime import copy_to_device

    device = torch.device("cuda", 0)
    gen = torch.Generator().manual_seed(0)
    # 8 x 8193 int64: 512 KiB a tensor, more than a driver's staging buffer holds at once
    batch = {k: torch.randint(0, 1000, (8, 8193), generator=gen) for k in ("input_ids", "labels")}

    def waited(copy) -> bool:
        """Whether `copy()` returned only after ~1 s of queued GPU sleep had ended."""
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time at H200 clocks
        busy = torch.cuda.Event()
        busy.record()
        out = copy()
        finished = busy.query()
        torch.cuda.synchronize()
        assert all(torch.equal(out[k].cpu(), batch[k]) for k in batch)
        return finished

    copy_to_device(batch, device)  # warm-up: the CUDA context and the cached pinned blocks
    pageable = waited(lambda: {k: v.to(device, non_blocking=True) for k, v in batch.items()})
    print(f"a pageable non_blocking copy waited for the queued kernels: {pageable}")
    assert not waited(lambda: copy_to_device(batch, device))
