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

from tt_slice import trainer_config  # bench/peers/: the config both slices share

from torchtitan.models.llama3 import model_registry
from torchtitan.trainer import Trainer

VOCAB = 128256


def _slice(converters=None) -> Trainer.Config:
    layers = int(os.environ.get("TT_LAYERS", "8"))
    spec = model_registry("8B", attn_backend=os.environ.get("TT_ATTN", "flex"), converters=converters)
    spec = dataclasses.replace(spec, flavor=f"8B_l{layers}",
                               model=dataclasses.replace(spec.model, layers=spec.model.layers[:layers]))
    return trainer_config(spec, VOCAB, local_batch_size=1, seq_len=8192)


def llama3_8b_slice() -> Trainer.Config:
    return _slice()


def llama3_8b_slice_rowwise() -> Trainer.Config:
    from torchtitan.components.quantization import Float8LinearConverter

    skip = [] if os.environ.get("TT_FP8_HEAD") == "1" else ["lm_head"]
    return _slice([Float8LinearConverter.Config(recipe_name="rowwise", filter_fqns=skip,
                                                model_compile_enabled=True)])
