"""The torchtitan 0.3.0 Trainer.Config our peer slices share (tt_qwen3_moe.py, tt_llama3_8b_slice.py):
random tokens from the kit's tt_bench.py (no tokenizer files, no network), plain cross-entropy,
AdamW at 3e-4 with 10 warm-up steps, bf16 params / fp32 reduce, FSDP over every rank, no CUDA
graphs, no checkpoints, no activation checkpointing, compile off unless `--compile.enable`."""

from __future__ import annotations

import os

from tt_bench import NullTokenizer, SyntheticDataLoader  # the kit's: staged in .peers/

from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.components.optimizer import default_adamw, LRSchedulersContainer
from torchtitan.components.validate import Validator
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.trainer import Trainer


def trainer_config(spec, vocab: int, *, local_batch_size: int, seq_len: int) -> Trainer.Config:
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path=".",
        dump_folder=os.environ.get("TT_DUMP", "./tt_outputs"),
        tokenizer=NullTokenizer.Config(vocab_size=vocab),
        dataloader=SyntheticDataLoader.Config(vocab_size=vocab),
        loss=CrossEntropyLoss.Config(global_vocab_size=vocab),  # tt_bench.py says why not the chunked loss
        optimizer=default_adamw(lr=3e-4),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=10, decay_type="cosine"),
        training=TrainingConfig(local_batch_size=local_batch_size, seq_len=seq_len, steps=40,
                                disable_cuda_graphs=True, mixed_precision_param="bfloat16",
                                mixed_precision_reduce="float32"),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1,
                                      spmd_backend=os.environ.get("TT_SPMD", "partial_dtensor")),
        metrics=MetricsProcessor.Config(log_freq=5),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,
        compile=CompileConfig(enable=False),
        validator=Validator.Config(enable=False),
    )
