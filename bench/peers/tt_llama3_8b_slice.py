"""torchtitan 0.3.0 config modules: its own Llama-3 8B (`torchtitan.models.llama3`, flavor "8B": dim
4096, 32 heads (8 kv), ffn 14336, vocab 128256 untied) cut to its first TT_LAYERS layers (default 8),
the slice that `model=gpt model.preset=8b model.n_layers=8` trains in this launcher (issue 26's
torchao FP8 rows, scripts/bench_peers.py entries tt_8b*). Seq 8192, local batch 1, bf16 params /
fp32 reduce, fp32 master weights, random tokens (tt_bench.py's), no tokenizer files, no network.

`llama3_8b_slice` is bf16; `llama3_8b_slice_rowwise` converts the Linears to torchao float8 with
rowwise scales through torchtitan's own Float8LinearConverter (the head stays bf16, as in
torchtitan's float8 examples, unless TT_FP8_HEAD=1). Both want `--compile.enable`: torchtitan
compiles each block, which is where the FP8 casts fuse.

  PYTHONPATH=/tmp/ttsite:.peers:bench/peers torchrun --standalone --nproc-per-node 1 \\
      .peers/tt_launch.py --module tt_llama3_8b_slice --config llama3_8b_slice_rowwise \\
      --training.disable_cuda_graphs --compile.enable
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
from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer

VOCAB = 128256


def _slice(converters=None) -> Trainer.Config:
    layers = int(os.environ.get("TT_LAYERS", "8"))
    spec = model_registry("8B", attn_backend=os.environ.get("TT_ATTN", "flex"), converters=converters)
    spec = dataclasses.replace(spec, flavor=f"8B_l{layers}",
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
        training=TrainingConfig(local_batch_size=1, seq_len=8192, steps=40, disable_cuda_graphs=True,
                                mixed_precision_param="bfloat16", mixed_precision_reduce="float32"),
        parallelism=ParallelismConfig(data_parallel_shard_degree=-1,
                                      spmd_backend=os.environ.get("TT_SPMD", "partial_dtensor")),
        metrics=MetricsProcessor.Config(log_freq=5),
        checkpoint=CheckpointManager.Config(enable=False),
        activation_checkpoint=None,
        compile=CompileConfig(enable=False),
        validator=Validator.Config(enable=False),
    )


def llama3_8b_slice() -> Trainer.Config:
    return _slice()


def llama3_8b_slice_rowwise() -> Trainer.Config:
    from torchtitan.components.quantization import Float8LinearConverter

    skip = [] if os.environ.get("TT_FP8_HEAD") == "1" else ["lm_head"]
    return _slice([Float8LinearConverter.Config(recipe_name="rowwise", filter_fqns=skip,
                                                model_compile_enabled=True)])
