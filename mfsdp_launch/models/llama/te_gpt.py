"""Family `te_gpt`: the `gpt` architecture on Transformer Engine layers (models/llama/te_modules.py)."""

from __future__ import annotations

import fnmatch
from typing import List

from ...core.fp8 import FP8_GEMM_MULTIPLE
from ...core.errors import ConfigError
from . import dims as L
from ..family import ModelContext, ModelSpec, Parallel, find_module
from .gpt import GPTFamily


class TEGPTFamily(GPTFamily):
    name = "te_gpt"
    has_te_layers = True
    # TEGPT.forward(input_ids, doc_ids): attention per document through TE's variable-length (THD)
    # attention (models/llama/te_modules.py); validation refuses it with mesh.tp > 1 and fp8.attention.
    doc_mask = True
    lora = False  # peft's LoRA layers wrap torch.nn.Linear, not TE's fused LayerNormLinear/LayerNormMLP
    # TE's tp_size/sequence_parallel at build (`spec_for`), its tp and cp groups wired after it
    # (models/llama/te_parallel.py); TE's context-parallel attention is a p2p ring.
    tp_mode = Parallel.TE
    cp_mode = Parallel.TE
    expert_parallel = False  # no mixture of experts in TE's TransformerLayer (check refuses model.moe)
    linear_fp8 = False  # its matmuls are TE layers: TE's own FP8 recipes

    def shape(self, m) -> dict:
        # Manifests record fuse_qkv with every TE family's shape; te_gpt's layers always fuse QKV in
        # TE's own layout, and its manifests have always recorded false.
        return {**super().shape(m), "fuse_qkv": False}

    def spec_for(self, m, seq_len: int, tp: int = 1):
        return self.spec(m, seq_len, tp=tp) if tp > 1 else self.spec(m, seq_len)

    def parallelize(self, model, m, dims, mesh) -> None:
        if dims.tp > 1 or dims.cp > 1:
            from .te_modules import wire_parallel

            wire_parallel(model, mesh, dims.tp, dims.cp)
        self.apply_activation_checkpointing(model, m)

    def check(self, m, ctx: ModelContext) -> List[str]:
        d = self.dims(m)
        self.check_loss_kernel(m)
        # TE's TransformerLayer is the dense block; the mixture of experts and Qwen3's attention
        # variants are gpt's (TE GroupedLinear experts are not wired).
        for key, used in (("model.moe.experts", d.moe is not None), ("model.qk_norm", d.qk_norm),
                          ("model.head_dim", bool(d.head_size) and d.head_size != d.dim // d.n_heads)):
            if used:
                raise ConfigError(key, f"model={self.name}'s TE TransformerLayer has no {key.split('.')[-1]}",
                                  "model=gpt, or leave it unset")
        self.check_init_from(m)
        if ctx.fp8_params and not m.init_on_meta:
            # Seen on one H200 (TE 2.20): TE's in-place init of quantized weights built on the GPU
            # fails (an illegal memory access; current scaling: "no data" for the amax).
            raise ConfigError("model.init_on_meta", f"false, but model={self.name} builds FP8 parameters "
                              "(fp8.params=true) on the meta device only", "true")
        self.check_tp_dims(d, ctx)
        if ctx.tp > 1 and ctx.engine and ctx.engine != "megatron_fsdp":
            raise ConfigError("mesh.tp", f"model={self.name} is tensor-parallel inside its TE layers, whose "
                              f"shards engine={ctx.engine} cannot checkpoint as whole tensors", "1, or engine=megatron_fsdp")
        if ctx.tp > 1 and m.init_from:
            # models/hf_weights.py slices a rank's rows out of the tp=1 tensor by its DTensor offsets; TE's
            # fused SwiGLU fc1 shard [gate_r | up_r] is not such a block (engines/glu_layout.py).
            raise ConfigError("model.init_from", f"is not wired for model={self.name} with mesh.tp={ctx.tp}",
                              "mesh.tp=1 (then resume at any tp from its checkpoint)")
        if ctx.fp8_recipe != "none":
            _check_fp8_shapes(d, ctx)
        return []

    def resolve(self, m, compute_dtype) -> None:
        super().resolve(m, compute_dtype)  # model.init_from's dims
        # TE layers compute in their parameters' dtype (FP8 weights keep it as the high-precision copy).
        if m.params_dtype is None:
            m.params_dtype = compute_dtype

    def matmuls(self, m, seq_len: int, linears=None):
        from .matmuls import te_gpt_matmuls

        return te_gpt_matmuls(self.dims(m), seq_len)

    def largest_unit_params(self, m) -> int:
        d = self.dims(m)  # the te.Linear head is a unit of its own
        head = 0 if d.tie_embeddings else d.vocab_size * d.dim
        return max(L.layer_params(d), d.vocab_size * d.dim + d.dim, head)

    def spec(self, m, seq_len: int, tp: int = 1) -> ModelSpec:
        from ...components.precision import torch_dtype
        from . import te_modules

        te = te_modules.te_module(self.name)
        dims, dtype = self.dims(m), torch_dtype(m.params_dtype)
        # The head (te.Linear) is its own unit, as in the seed's TE test; te.Linear layers inside a
        # TransformerLayer belong to that layer's unit.
        return self._spec(m, seq_len, build=lambda: te_modules.TEGPT(dims, params_dtype=dtype, tp=tp),
                          unit_modules=(te.TransformerLayer, te.Linear),
                          init_weights=lambda model: find_module(model, te_modules.TEGPT).init_weights())


def _check_fp8_shapes(d: L.GPTDims, ctx: ModelContext) -> None:
    """FP8 GEMMs need every dimension divisible by 16; the head may be kept out via fp8.skip."""
    head_in_fp8 = not d.tie_embeddings and not any(fnmatch.fnmatchcase("lm_head", p) for p in ctx.fp8_skip)
    checks = [("model.dim", d.dim), ("model.ffn_dim", d.ffn_dim),
              ("train.micro_batch_size*train.seq_len", ctx.micro_batch_size * ctx.seq_len)]
    if head_in_fp8:
        checks.append(("model.vocab_size", d.vocab_size))
    for key, value in checks:
        if value % FP8_GEMM_MULTIPLE:
            hint = "or fp8.skip=[lm_head]" if key == "model.vocab_size" else "or fp8.recipe=none"
            raise ConfigError(key, f"{value} is not divisible by {FP8_GEMM_MULTIPLE}, which FP8 GEMMs need",
                              f"a multiple of {FP8_GEMM_MULTIPLE}, {hint}")


FAMILY = TEGPTFamily()
