"""Family `gpt`: the LLaMA-style GPT in plain PyTorch (models/llama/gpt_modules.py)."""

from __future__ import annotations

from typing import List

from ...core.errors import ConfigError
from . import dims as L
from .moe_dims import check_expert_split
from .config import GPTModelConfig
from ..family import ModelContext, ModelFamily, ModelSpec, Parallel, find_module
from ..losses import loss_for


class GPTFamily(ModelFamily):
    name = "gpt"
    section = GPTModelConfig
    # model.activation_checkpointing wraps each Block / TE TransformerLayer (models/activation_checkpoint.py).
    activation_checkpointing = True
    doc_mask = True  # GPT.forward(input_ids, doc_ids): attention per document (models/doc_attention.py)
    tp_mode = Parallel.DTENSOR  # models/llama/tensor_parallel.py
    cp_mode = Parallel.ALLGATHER  # models/llama/context_parallel.py
    lora = True  # peft adapters on its nn.Linear layers (wqkv, wo, w_gate_up, w_down, lm_head)
    base_key = "model.init_from"
    base_hint = "a local Llama-layout Hugging Face directory"
    linear_fp8 = True  # plain nn.Linear matmuls (components/float8.py)
    expert_parallel = True  # model.moe's experts over mesh.ep (models/llama/expert_parallel.py)
    experts_from = "model.moe"

    def parallelize(self, model, m, dims, mesh) -> None:
        if dims.tp > 1:
            from .tensor_parallel import parallelize_gpt
            from .gpt_modules import GPT

            parallelize_gpt(find_module(model, GPT), mesh["tp"])
        if dims.cp > 1:
            from .context_parallel import apply_context_parallel

            apply_context_parallel(model, mesh["cp"])
        if getattr(dims, "ep", 1) > 1:
            from .expert_parallel import apply_expert_parallel

            apply_expert_parallel(model, mesh, dims)
        self.apply_activation_checkpointing(model, m)

    def dims(self, m) -> L.GPTDims:
        return L.resolve_gpt_dims(m)

    def check(self, m, ctx: ModelContext) -> List[str]:
        d = self.dims(m)  # every dimension rule, with the key that breaks it
        self.check_loss_kernel(m)
        self.check_variants(d, m, ctx)
        self.check_init_from(m)
        self.check_tp_dims(d, ctx)
        return []

    def check_loss_kernel(self, m) -> None:
        if str(m.loss_kernel) == "chunked":  # the Llama family's memory-lean loss is TE's fused kernel
            raise ConfigError("model.loss_kernel", f"chunked is model=hf's; model={self.name} has te_fused "
                              "(TE's kernel on the bf16 logits)", "torch, te_fused")

    def check_variants(self, d: L.GPTDims, m, ctx: ModelContext) -> None:
        """What the MoE and Qwen3-style attention variants do not combine with (yet), and mesh.ep."""
        variant = ("model.moe.experts" if d.moe is not None else "model.qk_norm" if d.qk_norm
                   else "model.head_dim" if d.head_size else None)
        if variant and ctx.tp > 1:
            raise ConfigError("mesh.tp", f"{ctx.tp} with {variant}: the DTensor tensor-parallel plan covers the "
                              "dense attention and MLP only", "1 (mesh.ep splits the experts instead)")
        if variant and m.init_from:
            raise ConfigError("model.init_from", f"reads Llama-layout directories, which have no {variant}",
                              f"null, or a dense model without {variant}")
        check_expert_split(ctx.ep, 0 if d.moe is None else d.moe.experts,
                           model=f"model={self.name} preset={m.preset}", source="model.moe.experts",
                           dense_hint="model.moe.experts=N")

    def check_tp_dims(self, d: L.GPTDims, ctx: ModelContext) -> None:
        """What tp must divide (gpt's DTensor plan and te_gpt's TE layers alike). tp dividing
        n_heads is validation's generic rule for every family with attention."""
        if ctx.tp > 1 and d.n_kv_heads % ctx.tp:
            raise ConfigError("mesh.tp", f"{ctx.tp} does not divide the {d.n_kv_heads} key/value heads of "
                              f"model={self.name} (model.n_kv_heads)", "a divisor of model.n_kv_heads")
        if ctx.tp > 1 and d.ffn_dim % ctx.tp:
            raise ConfigError("mesh.tp", f"{ctx.tp} does not divide model.ffn_dim={d.ffn_dim}")
        if ctx.tp > 1 and ctx.seq_len % (ctx.cp * ctx.tp):
            # Sequence parallelism splits each cp rank's seq_len/cp tokens over tp.
            raise ConfigError("train.seq_len", f"{ctx.seq_len} is not divisible by mesh.cp*mesh.tp="
                              f"{ctx.cp * ctx.tp} (sequence parallelism)", f"a multiple of {ctx.cp * ctx.tp}")

    # --- model.init_from: a Llama-layout HF directory (models/llama/hf_config.py, models/hf_weights.py) -----------------

    def resolve(self, m, compute_dtype) -> None:
        """Dims left unset (and norm_eps/rope_theta at their defaults) come from init_from's config.json,
        rope_scaling (null) too."""
        if not m.init_from:
            return
        from .hf_config import DIMS_TO_LLAMA, read_llama_dims

        hf, defaults = read_llama_dims(m.init_from, key="model.init_from"), GPTModelConfig()
        for field, _ in DIMS_TO_LLAMA:
            value = getattr(m, field)
            if value is None or (getattr(defaults, field) is not None and value == getattr(defaults, field)):
                theirs = getattr(hf, field)
                # The config holds model.rope_scaling as the mapping a user writes, not the dataclass.
                setattr(m, field, theirs.to_config() if isinstance(theirs, L.RopeScaling) else theirs)

    def check_init_from(self, m) -> None:
        if not m.init_from:
            return
        from pathlib import Path

        from .hf_config import CONFIG_FILE, check_dims_match, read_llama_dims
        from .hf_export import INDEX_FILE, SINGLE_FILE

        source = str(Path(m.init_from).expanduser() / CONFIG_FILE)
        check_dims_match(self.dims(m), read_llama_dims(m.init_from, key="model.init_from"), source=source)
        d = Path(m.init_from).expanduser()
        if not ((d / SINGLE_FILE).is_file() or (d / INDEX_FILE).is_file()):
            raise ConfigError("model.init_from", f"{d} has no {SINGLE_FILE} or {INDEX_FILE}")

    def load_weights(self, m, model, engine) -> None:
        if not m.init_from:
            return
        from . import hf_keys as llama_keys
        from ..hf_weights import announce, load_into_model

        report = load_into_model(model, m.init_from, engine=engine, key="model.init_from",
                                 sources=llama_keys.sources(self.dims(m), self.name))
        announce(report, key="model.init_from", source=m.init_from)

    def base_dir(self, m):
        return m.init_from

    def modules(self, m, seq_len: int) -> dict:
        from ..meta import meta_modules

        return meta_modules(m, seq_len)

    def n_heads(self, m) -> int:
        return self.dims(m).n_heads

    def vocab_size(self, m) -> int:
        return self.dims(m).vocab_size

    def shape(self, m) -> dict:
        return self.dims(m).shape()

    def param_count(self, m) -> int:
        return L.param_count(self.dims(m))

    def active_params(self, m) -> int:
        return L.active_params(self.dims(m))

    def muon_matrix_params(self, m) -> int:
        return L.muon_matrix_params(self.dims(m))

    def experts(self, m) -> int:
        moe = self.dims(m).moe
        return 0 if moe is None else moe.experts

    def expert_params(self, m) -> int:
        return L.expert_params(self.dims(m))

    def unit_expert_params(self, m) -> int:
        d = self.dims(m)
        if d.moe is None or self._root_params(d) >= max(L.layer_params(d, i) for i in range(d.n_layers)):
            return 0
        return d.moe.expert_params(d.dim)  # the largest unit is a MoE block

    def flops_per_token(self, m, seq_len: int) -> float:
        return L.flops_per_token(self.dims(m), seq_len)

    def matmuls(self, m, seq_len: int, linears=None):
        from .matmuls import gpt_matmuls

        return gpt_matmuls(self.dims(m), seq_len)

    def activation_bytes(self, m, micro_batch_size: int, seq_len: int, bytes_per_el: int, tp: int = 1) -> int:
        return sum(self.activation_parts(m, micro_batch_size, seq_len, bytes_per_el, tp=tp).values())

    def activation_parts(self, m, micro_batch_size: int, seq_len: int, bytes_per_el: int, tp: int = 1,
                         compiled: bool = False) -> dict:
        return L.activation_parts(self.dims(m), micro_batch_size, seq_len, bytes_per_el,
                                  str(m.activation_checkpointing), m.ac_every, tp, te_layers=self.has_te_layers,
                                  loss_kernel=str(m.loss_kernel), compiled=compiled)

    def largest_unit_params(self, m) -> int:
        # Units: each Block; the root holds the embedding, final norm and head.
        d = self.dims(m)
        return max(max(L.layer_params(d, i) for i in range(d.n_layers)), self._root_params(d))

    @staticmethod
    def _root_params(d: L.GPTDims) -> int:
        head = 0 if d.tie_embeddings else d.vocab_size * d.dim
        return d.vocab_size * d.dim + d.dim + head

    def describe(self, m, seq_len: int) -> str:
        d = self.dims(m)
        line = f"{self.name} {L.describe(d, m.preset)} " + super().describe(m, seq_len).split(" ", 1)[1]
        if d.moe is None:
            return line
        # A mixture of experts: what a token uses (FLOPs and MFU count these), and what mesh.ep splits.
        return line.replace(" flops/token=", f" active={L.active_params(d):,} experts={L.expert_params(d):,}"
                            " flops/token=", 1)

    def _spec(self, m, seq_len: int, **parts) -> ModelSpec:
        loss = loss_for(m.loss_kernel)
        moe = {}
        if self.dims(m).moe is not None:
            from .moe_stats import after_step, moe_loss

            loss, moe = moe_loss(loss), {"after_step": after_step}
        return ModelSpec(name=self.name, loss=loss, uses_tokens=True, synthetic_batch=None,
                         tokens_per_sample=seq_len, num_params=self.param_count(m),
                         flops_per_token=self.flops_per_token(m, seq_len), vocab_size=self.vocab_size(m),
                         **moe, **parts)

    def spec(self, m, seq_len: int) -> ModelSpec:
        from ...components.precision import torch_dtype
        from .gpt_modules import GPT, Block

        dims, dtype = self.dims(m), torch_dtype(m.params_dtype)
        return self._spec(m, seq_len, build=lambda: GPT(dims, dtype=dtype), unit_modules=(Block,),
                          init_weights=lambda model: find_module(model, GPT).init_weights())


FAMILY = GPTFamily()
