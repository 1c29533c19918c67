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

from tt_bench import NullTokenizer, SyntheticDataLoader  # the kit's: staged in .peers/

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import default_adamw, LRSchedulersContainer
from torchtitan.components.validate import Validator
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.models.qwen3 import model_registry
from torchtitan.trainer import Trainer

VOCAB = 151936


def qwen3_30b_a3b_slice() -> Trainer.Config:
    layers = int(os.environ.get("TT_LAYERS", "4"))
    spec = model_registry("30B-A3B", attn_backend=os.environ.get("TT_ATTN", "flex"))
    spec = dataclasses.replace(spec, flavor=f"30B-A3B_l{layers}",
                               model=dataclasses.replace(spec.model, layers=spec.model.layers[:layers]))
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path=".",
        dump_folder=os.environ.get("TT_DUMP", "./tt_outputs"),
        tokenizer=NullTokenizer.Config(vocab_size=VOCAB),
        dataloader=SyntheticDataLoader.Config(vocab_size=VOCAB),
        loss=CrossEntropyLoss.Config(global_vocab_size=VOCAB),  # tt_bench.py says why not the chunked loss
        optimizer=default_adamw(lr=3e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=10, decay_type="cosine"),
        training=TrainingConfig(local_batch_size=2, seq_len=4096, steps=40, disable_cuda_graphs=True,
                                mixed_precision_param="bfloat16", mixed_precision_reduce="float32"),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1,
                                      spmd_backend=os.environ.get("TT_SPMD", "partial_dtensor")),
        metrics=MetricsProcessor.Config(log_freq=5),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,
        compile=CompileConfig(enable=False),
        validator=Validator.Config(enable=False),
    )
