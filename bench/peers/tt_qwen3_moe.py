"""torchtitan 0.3.0 config module: its own Qwen3-30B-A3B MoE (`torchtitan.models.qwen3`, flavor
"30B-A3B": dim 2048, 32 heads (4 kv) of 128 with qk-norm, 128 experts of ffn 768, top-8 softmax
routing renormalized, vocab 151936 untied) cut to its first TT_LAYERS layers (default 4), the slice
that `model.preset=qwen3-30b-a3b model.n_layers=4` trains in this launcher (scripts/bench_peers.py
entries tt_moe*). Seq 4096, local batch 2, bf16 params / fp32 reduce, fp32 master weights, no
expert parallelism (one GPU), random tokens from the kit's tt_bench.py (no tokenizer files, no
network). Its auxiliary-loss-free load balancing stays on, as torchtitan ships it.

Run it as the kit runs tt_bench (../shared/peers/README.md), with this directory on PYTHONPATH:

  PYTHONPATH=/tmp/ttsite:.peers:bench/peers torchrun --standalone --nproc-per-node 1 \\
      .peers/tt_launch.py --module tt_qwen3_moe --config qwen3_30b_a3b_slice --training.disable_cuda_graphs
"""

from __future__ import annotations

import dataclasses
import os

from tt_slice import trainer_config  # bench/peers/: the config both slices share

from torchtitan.models.qwen3 import model_registry
from torchtitan.trainer import Trainer

VOCAB = 151936


def qwen3_30b_a3b_slice() -> Trainer.Config:
    layers = int(os.environ.get("TT_LAYERS", "4"))
    spec = model_registry("30B-A3B", attn_backend=os.environ.get("TT_ATTN", "flex"))
    spec = dataclasses.replace(spec, flavor=f"30B-A3B_l{layers}",
                               model=dataclasses.replace(spec.model, layers=spec.model.layers[:layers]))
    return trainer_config(spec, VOCAB, local_batch_size=2, seq_len=4096)
