"""Full-iteration CUDA graphs for Megatron-FSDP (train.cuda_graph=full_iteration).

Forward + loss + backward (with Megatron-FSDP's gradient reduction and its installation of the
reduced gradients into the optimizer's parameters) are captured once into one CUDA graph and
replayed every step, as in Megatron-FSDP's `test_full_iteration_cuda_graph`:

* the model is wrapped with `cuda_graph_mode=True` (the engine does it when its
  `cuda_graph_mode` is set), and its main gradients have the main weights' dtype (validated), so
  `param.grad` is a stable view of the sharded gradient buffer that every replay writes into;
* the optimizer is not captured: it steps eagerly between replays (torch's AdamW as it is, TE
  FusedAdam made `capturable=True` by the engine) and is zeroed with
  `zero_grad(set_to_none=False)` so the views survive;
* inputs live in static buffers: each step's batch is copied into them before the replay;
* before capture, a few eager iterations run on a side stream (lazy initialisation, allocator
  warm-up, and under train.compile the compilation of every block's forward and backward, so the
  capture records Inductor's kernels and a replay runs neither Dynamo's guards nor the engine's
  Python hooks). They run with LR 0 and the optimizer state is restored afterwards, so the
  warm-up does not change the training trajectory.

The loop calls `step_fn()` (one replay, returning the static loss tensor) instead of its own
forward/backward, then clips, steps and zeroes as usual.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from .optim import set_lr


class FullIterationCudaGraph:
    """A replayable training iteration. Call it once per optimizer step; returns the loss.

    `next_batch(step, micro)` gives the batch of a step (micro is always 0: gradient accumulation
    is refused with full-iteration graphs); `start_step` is the step the first call trains.
    Capture happens on the first call, so it follows a checkpoint resume.
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, optimizer, next_batch: Callable,
                 *, forward_context: Optional[Callable] = None, start_step: int = 0, warmup_iters: int = 3,
                 process_group=None):
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.next_batch = next_batch
        self.forward_context = forward_context or nullcontext
        self.step = int(start_step)
        self.warmup_iters = int(warmup_iters)
        self.process_group = process_group
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.static_batch: Optional[Dict[str, torch.Tensor]] = None
        self.static_loss: Optional[torch.Tensor] = None

    # -------------------------------------------------------------------- capture

    def _run_iteration(self) -> torch.Tensor:
        with self.forward_context():
            loss = self.loss_fn(self.model, self.static_batch)
        loss.backward()
        return loss

    def _snapshot_optimizer(self):
        """Copies of every optimizer tensor that a step changes, and the LRs."""
        state = {id(p): {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in s.items()}
                 for p, s in self.optimizer.state.items()}
        groups = []
        for g in self.optimizer.param_groups:
            groups.append({k: (v.detach().clone() if torch.is_tensor(v) else v)
                           for k, v in g.items() if k != "params"})
        return state, groups

    def _restore_optimizer(self, snap) -> None:
        state, groups = snap
        with torch.no_grad():
            for p, s in self.optimizer.state.items():
                saved = state.get(id(p), {})
                for k, v in list(s.items()):
                    if k in saved:
                        if torch.is_tensor(v) and torch.is_tensor(saved[k]):
                            v.copy_(saved[k])
                        else:
                            s[k] = saved[k]
            for g, saved in zip(self.optimizer.param_groups, groups):
                for k, v in saved.items():
                    if torch.is_tensor(g.get(k)) and torch.is_tensor(v):
                        g[k].copy_(v)
                    else:
                        g[k] = v

    def capture(self, batch: Dict[str, torch.Tensor]) -> None:
        self.static_batch = {k: v.clone() for k, v in batch.items()}
        snap = self._snapshot_optimizer()
        for group in self.optimizer.param_groups:
            set_lr(group, 0.0)
        # Side-stream warm-up: lazy init and allocations happen before capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup_iters):
                self.optimizer.zero_grad(set_to_none=False)
                self._run_iteration()
                self.optimizer.step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self._restore_optimizer(snap)
        self.optimizer.zero_grad(set_to_none=False)
        if dist.is_initialized():
            dist.barrier(group=self.process_group)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        capture_stream = torch.cuda.Stream()
        with torch.cuda.graph(self.graph, stream=capture_stream, capture_error_mode="thread_local"):
            self.static_loss = self._run_iteration()
        torch.cuda.synchronize()
        if dist.is_initialized():
            dist.barrier(group=self.process_group)
        if not dist.is_initialized() or dist.get_rank() == 0:  # the run says the graph is in use
            print(f"train.cuda_graph: full_iteration: step {self.step + 1} captured after {self.warmup_iters} "
                  "warm-up iterations at LR 0; every step replays it", flush=True)

    # -------------------------------------------------------------------- replay

    def __call__(self) -> torch.Tensor:
        batch = self.next_batch(self.step, 0)
        if self.graph is None:
            self.capture(batch)
        else:
            for k, v in batch.items():
                self.static_batch[k].copy_(v, non_blocking=True)
        self.graph.replay()
        self.step += 1
        return self.static_loss

    def release(self) -> None:
        """Free the graph before the process groups go: NCCL's communicator teardown waits for
        the CUDA graphs that captured its kernels."""
        if self.graph is not None:
            torch.cuda.synchronize()
            self.graph.reset()
            self.graph = None
