"""Family `gpt`: the LLaMA-style GPT in plain PyTorch (models/gpt_modules.py)."""

from __future__ import annotations

from typing import List

from . import llama_dims as L
from .family import ModelContext, ModelFamily, ModelSpec, find_module, lm_loss


class GPTFamily(ModelFamily):
    name = "gpt"

    def dims(self, m) -> L.GPTDims:
        return L.resolve_gpt_dims(m)

    def check(self, m, ctx: ModelContext) -> List[str]:
        self.dims(m)  # every dimension rule, with the key that breaks it
        return []

    def n_heads(self, m) -> int:
        return self.dims(m).n_heads

    def vocab_size(self, m) -> int:
        return self.dims(m).vocab_size

    def shape(self, m) -> dict:
        return self.dims(m).shape()

    def param_count(self, m) -> int:
        return L.param_count(self.dims(m))

    def flops_per_token(self, m, seq_len: int) -> float:
        return L.flops_per_token(self.dims(m), seq_len)

    def activation_bytes(self, m, micro_batch_size: int, seq_len: int, bytes_per_el: int) -> int:
        return L.activation_bytes(self.dims(m), micro_batch_size, seq_len, bytes_per_el,
                                  bool(m.activation_checkpointing))

    def largest_unit_params(self, m) -> int:
        # Units: each Block; the root holds the embedding, final norm and head.
        d = self.dims(m)
        head = 0 if d.tie_embeddings else d.vocab_size * d.dim
        return max(L.layer_params(d), d.vocab_size * d.dim + d.dim + head)

    def describe(self, m, seq_len: int) -> str:
        return f"{self.name} {L.describe(self.dims(m), m.preset)} " + super().describe(m, seq_len).split(" ", 1)[1]

    def _spec(self, m, seq_len: int, **parts) -> ModelSpec:
        return ModelSpec(name=self.name, loss=lm_loss, uses_tokens=True, synthetic_batch=None,
                         tokens_per_sample=seq_len, num_params=self.param_count(m),
                         flops_per_token=self.flops_per_token(m, seq_len), vocab_size=self.vocab_size(m), **parts)

    def spec(self, m, seq_len: int) -> ModelSpec:
        from ..precision import torch_dtype
        from .gpt_modules import GPT, Block

        dims, dtype = self.dims(m), torch_dtype(m.params_dtype)
        return self._spec(m, seq_len, build=lambda: GPT(dims, dtype=dtype), unit_modules=(Block,),
                          init_weights=lambda model: find_module(model, GPT).init_weights())


FAMILY = GPTFamily()
