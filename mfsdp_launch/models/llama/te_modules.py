"""Models built from Transformer Engine (TE 2.x) modules: the seed's ToyTETransformer and TEGPT.

Import-safe without TE: TE is imported by `te_module()` inside constructors and functions, only when a
te_* model is actually built. TE modules need CUDA; under `with torch.device("meta")` they are
built on the meta device (TE takes an explicit `device` argument, so we pass it on).

Layout: TEGPT runs its TransformerLayers batch-first (`attn_input_format="bshd"`), like `gpt`.
ToyTETransformer keeps the seed's TE default, seq-first `[s, b, h]`.

Document masks (data.doc_mask): `TEGPT.forward(input_ids, doc_ids, cu_seqlens)` runs that call in TE's
variable-length THD layout: the [B, T] batch is one stream of B * T tokens cut at every document and
row end (`thd_arguments`), attention "padding_causal" inside each piece, so no T x T mask exists.
TE's fused RoPE restarts positions at 0 in every THD sequence; `gpt` does not restart them, but RoPE
scores depend only on the distance between two tokens, so both compute the same attention.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...corpus.doc_mask import cu_seqlens as doc_segments
from ..doc_attention import KERNELS
from .gpt_modules import Embedding, RMSNorm, rope_angles
from .dims import GPTDims, RopeScaling

INIT_STD = 0.02
TE_DEFAULT_INIT_STD = 0.023  # TE's get_default_init_method()


def te_import_error(model_name: str, exc: BaseException) -> RuntimeError:
    lines = str(exc).strip().splitlines()
    reason = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return RuntimeError(
        f"Transformer Engine is required for model={model_name} but could not be imported: {reason}"
    )


def te_module(model_name: str = "te_gpt"):
    """`transformer_engine.pytorch`, or a RuntimeError with a one-line reason.

    A half-installed TE (python package present, core library missing) raises RuntimeError or
    OSError rather than ImportError, so every exception is caught.
    """
    try:
        import transformer_engine.pytorch as te
    except Exception as exc:  # noqa: BLE001 - see docstring
        raise te_import_error(model_name, exc) from exc
    return te


def te_device() -> str:
    """Device argument for TE modules: "meta" inside `with torch.device("meta")` (TE compares
    against the string), else "cuda" (TE's current CUDA device)."""
    return "meta" if torch.get_default_device().type == "meta" else "cuda"


class ToyTETransformer(torch.nn.Module):
    """Toy Transformer model for testing Megatron-FSDP with Transformer Engine."""

    def __init__(
        self,
        model_dim,
        num_heads,
        num_layers,
        output_dim,
        fuse_qkv_params=False,
        params_dtype=torch.float32,
        device="cuda",
    ):
        super().__init__()
        te = te_module("te_toy_transformer")
        self.layers = torch.nn.ModuleList(
            [
                te.TransformerLayer(
                    hidden_size=model_dim,
                    ffn_hidden_size=model_dim,
                    num_attention_heads=num_heads,
                    fuse_qkv_params=fuse_qkv_params,
                    params_dtype=params_dtype,
                    device=device,
                )
                for _ in range(num_layers)
            ]
        )
        self.fc_out = te.Linear(model_dim, output_dim, params_dtype=params_dtype, device=device)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        x = self.fc_out(x)
        return x


class ScaledRotaryEmbedding(nn.Module):
    """TE RotaryPositionEmbedding's table for a Llama-3-scaled RoPE, which TE's module has no
    option for: `forward(max_seq_len, offset)` gives the same [S, 1, 1, dim] fp32 angles
    (frequencies repeated over both halves), from gpt's inv_freq (gpt_modules.rope_inv_freq).
    It holds no tensors, so nothing of it reaches a state dict or needs to_empty()."""

    def __init__(self, dim: int, theta: float, scaling: Optional[RopeScaling], device=None):
        super().__init__()
        self.dim, self.theta, self.scaling = dim, theta, scaling
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)

    def forward(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        positions = torch.arange(max_seq_len, device=self.device, dtype=torch.float32) + offset
        return rope_angles(positions, self.dim, self.theta, self.device, self.scaling).view(max_seq_len, 1, 1, self.dim)


def rotary_embedding(dim: int, theta: float, scaling: Optional[RopeScaling] = None, device=None) -> nn.Module:
    """The RoPE table module of a te_gpt layer: TE's own for plain RoPE (today's runs, unchanged),
    ScaledRotaryEmbedding for Llama-3 scaling."""
    if scaling is None:
        return te_module().RotaryPositionEmbedding(dim, rotary_base=theta)
    return ScaledRotaryEmbedding(dim, theta, scaling, device)


@functools.lru_cache(maxsize=None)
def rope_transformer_layer_class():
    """A te.pytorch.TransformerLayer subclass that builds its own RoPE table at forward.

    The table holds fp32 angles. Were the parent to pass it in as `rotary_pos_emb`, FSDP2's
    `cast_forward_inputs` would cast it to bf16 at the layer's boundary, wrecking positions past
    a few hundred. Built lazily (TE is optional); isinstance checks against TransformerLayer, the
    FSDP unit class, still match.
    """
    te = te_module()

    class RopeTransformerLayer(te.TransformerLayer):
        def __init__(self, *args, rope_dim: int, rope_theta: float, rope_scaling: Optional[RopeScaling] = None,
                     **kwargs):
            super().__init__(*args, **kwargs)
            self.rope_dim, self.rope_theta, self.rope_scaling = rope_dim, rope_theta, rope_scaling
            # A plain dict, not a submodule: the RoPE module's inv_freq buffer would otherwise
            # land in state dicts and be wiped by to_empty() after meta-device init.
            self._rope = {}

        def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
            rope = self._rope.get("module")
            if rope is None:
                rope = rotary_embedding(self.rope_dim, self.rope_theta, self.rope_scaling, hidden_states.device)
                self._rope["module"] = rope
            if kwargs.get("cu_seqlens_q") is None:
                return super().forward(hidden_states, rotary_pos_emb=rope(self.rope_len(hidden_states)), **kwargs)
            # THD (`thd_arguments`): positions restart in every document, so a table of max_seqlen rows
            # covers them all. TE fixes the layout at construction (MultiheadAttention.qkv_format, which
            # it hands to its RoPE and DotProductAttention on every call): switched for this call only,
            # so one model runs both layouts, and here, inside forward, so that the recompute of a
            # checkpointed layer (model.activation_checkpointing) switches it too.
            KERNELS["te_thd"] += 1
            attention, built = self.self_attention, self.self_attention.qkv_format
            attention.qkv_format = "thd"
            try:
                return super().forward(hidden_states, rotary_pos_emb=rope(kwargs["max_seqlen_q"]), **kwargs)
            finally:
                attention.qkv_format = built

        def rope_len(self, hidden_states: torch.Tensor) -> int:
            """Positions the table covers: the whole sequence. Attention sees the tp-gathered
            sequence (sequence parallelism), and TE's fused RoPE picks each cp rank's two
            load-balanced chunks (cp_size/cp_rank offsets) out of the full-length table."""
            seq = hidden_states.shape[0 if self.attn_input_format == "sbhd" else 1]
            if self.sequence_parallel:
                seq *= self.tp_size
            return seq * getattr(self.self_attention, "cp_size", 1)

    return RopeTransformerLayer


@functools.lru_cache(maxsize=None)
def replicated_linear_class():
    """te.pytorch.Linear whose weights are not tagged tensor-parallel.

    TE tags every Linear weight `tensor_model_parallel` (partition_dim 0) in reset_parameters,
    with or without a parallel_mode. Under tp > 1 Megatron-FSDP would then take the head, which
    every tp rank holds whole, for a tp shard of a tp-times larger tensor. Megatron-FSDP's
    meta-device init calls reset_parameters again, hence the override rather than a one-off.
    """
    te = te_module()

    class ReplicatedLinear(te.Linear):
        def reset_parameters(self, defer_init=False):
            super().reset_parameters(defer_init=defer_init)
            for param in self.parameters():
                param.tensor_model_parallel = False

    return ReplicatedLinear


class TEGPT(nn.Module):
    """The `gpt` architecture on TE modules: input_ids [B, T] -> logits [B, T, vocab].

    Each layer is a TE TransformerLayer with fused QKV, RMSNorm, SwiGLU, causal attention, GQA,
    RoPE and no biases or dropout, so it holds the same tensors as gpt's Block. The output head is
    a te.pytorch.Linear, or the embedding weight itself when tied. The final norm is gpt's torch
    RMSNorm (same parameter).
    """

    def __init__(self, dims: GPTDims, params_dtype: Optional[torch.dtype] = None, tp: int = 1):
        super().__init__()
        te_module()  # a one-line error without TE, before any layer is built
        self.dims = dims
        # tp > 1: Megatron-style TP with sequence parallelism inside TE's layers (models/llama/te_parallel.py),
        # seq-first because TE's sequence parallelism splits dim 0; the group arrives with wire_parallel.
        self.tp, self.tp_group = tp, None
        parallel = dict(set_parallel_mode=True, tp_size=tp, sequence_parallel=True) if tp > 1 else {}
        dtype = params_dtype or torch.get_default_dtype()
        device = te_device()
        init = functools.partial(nn.init.normal_, mean=0.0, std=INIT_STD)
        out_init = functools.partial(
            nn.init.normal_, mean=0.0, std=INIT_STD / math.sqrt(2 * dims.n_layers)
        )
        layer_cls = rope_transformer_layer_class()
        # N(0, 0.02) on construction and in reset_parameters (Megatron-FSDP's meta-device init).
        self.tok_emb = Embedding(dims.vocab_size, dims.dim, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            layer_cls(
                hidden_size=dims.dim,
                ffn_hidden_size=dims.ffn_dim,
                num_attention_heads=dims.n_heads,
                num_gqa_groups=dims.n_kv_heads,
                kv_channels=dims.head_dim,
                layernorm_epsilon=dims.norm_eps,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                init_method=init,
                output_layer_init_method=out_init,
                layer_number=i + 1,
                self_attn_mask_type="causal",
                fuse_qkv_params=True,
                bias=False,
                activation="swiglu",
                normalization="RMSNorm",
                attn_input_format="sbhd" if tp > 1 else "bshd",
                params_dtype=dtype,
                device=device,
                rope_dim=dims.head_dim,
                rope_theta=dims.rope_theta,
                rope_scaling=dims.rope_scaling,
                **parallel,
            )
            for i in range(dims.n_layers)
        )
        # The final norm is the plain torch RMSNorm (one fused kernel): TE's op-based RMSNorm
        # replaces its Parameter in reset_parameters(), which Megatron-FSDP's meta init and
        # parameter swapping do not need to deal with for a module outside every FSDP unit.
        self.norm = RMSNorm(dims.dim, dims.norm_eps, dtype=dtype, device=device)
        self.lm_head = None
        if not dims.tie_embeddings:
            self.lm_head = replicated_linear_class()(
                dims.dim, dims.vocab_size, bias=False, init_method=init,
                params_dtype=dtype, device=device,
            )
        # TE modules initialized themselves from init_method/output_layer_init_method above, from the
        # global RNG in their own order, which depends on tp. Redraw tp-invariantly: here at tp=1,
        # in wire_parallel (which knows the tp rank) under tp.
        if tp == 1 and device != "meta":
            self.init_weights_tp_invariant(0)

    def forward(self, input_ids: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                cu_seqlens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """With `doc_ids` [B, T] (data.doc_mask; `cu_seqlens` the loader's, computed on the host) a
        token attends only to earlier tokens of its own document, through TE's THD attention."""
        x = self.tok_emb(input_ids)
        if doc_ids is not None:
            if self.tp > 1:  # validation refuses data.doc_mask with te_gpt's mesh.tp > 1
                raise ValueError("te_gpt: a document mask with tensor parallelism is not supported")
            B, T, dim = x.shape
            thd = thd_arguments(doc_ids, cu_seqlens, x.device)
            x = x.reshape(B * T, dim)  # THD: tokens first, no batch dimension
            for layer in self.layers:
                x = layer(x, **thd)
            x = self.norm(x).view(B, T, dim)
        elif self.tp > 1:
            from .te_parallel import gather_seq, scatter_seq

            # [B, T, H] -> [T, B, H], this tp rank's T/tp tokens; gathered back after the final norm.
            x = scatter_seq(x.transpose(0, 1), self.tp_group)
            for layer in self.layers:
                x = layer(x)
            x = gather_seq(self.norm(x), self.tp_group).transpose(0, 1)
        else:
            for layer in self.layers:
                x = layer(x)
            x = self.norm(x)
        return self.lm_head(x) if self.lm_head is not None else F.linear(x, self.tok_emb.weight)

    def init_weights(self) -> None:
        init_te_model(self, std=INIT_STD, out_std=INIT_STD / math.sqrt(2 * self.dims.n_layers))

    def init_weights_tp_invariant(self, tp_rank: int) -> None:
        """Every weight drawn at its full (tp=1) shape from one generator seeded alike on every
        rank (seed_all), TE's tp shards sliced out: a tp=N model starts as the tp=1 one does
        under this same draw. For unsharded (not yet wrapped) parameters."""
        generator = torch.Generator(device=next(self.parameters()).device).manual_seed(torch.initial_seed())
        init_te_model(self, std=INIT_STD, out_std=INIT_STD / math.sqrt(2 * self.dims.n_layers),
                      generator=generator, tp_rank=tp_rank, tp=self.tp)


def thd_arguments(doc_ids: torch.Tensor, cu_seqlens: Optional[torch.Tensor] = None, device=None) -> dict:
    """TransformerLayer.forward's keywords for attention per document over a [B, T] batch flattened to
    B * T tokens: one THD sequence per document and row (`cu_seqlens`, int32 [segments + 1]; from
    `doc_ids` when the loader gave none, corpus/doc_mask.py), causal inside each. TE's THD attention
    takes padding mask types only; "padding_causal" without padding between the sequences is causal
    per sequence. max_seqlen is T, which bounds every document: the exact maximum would cost a device
    sync (TE, left to itself, takes that sync and rounds the maximum up to a multiple of 64)."""
    cu = doc_segments(doc_ids) if cu_seqlens is None else cu_seqlens
    cu = cu.to(device=doc_ids.device if device is None else device, dtype=torch.int32)
    T = int(doc_ids.shape[-1])
    return dict(self_attn_mask_type="padding_causal", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=T,
                max_seqlen_kv=T)


def wire_parallel(model, mesh, tp: int, cp: int) -> None:
    """Give a built TEGPT its process groups: tp (sequence-parallel collectives) and cp (attention)."""
    import torch.distributed as dist

    from ..family import find_module

    gpt = find_module(model, TEGPT)
    if tp > 1:
        group = mesh["tp"].get_group()
        if gpt.tp != tp:
            raise ValueError(f"te_gpt was built for tp={gpt.tp}, the mesh has tp={tp}")
        gpt.tp_group = group
        for layer in gpt.layers:
            layer.set_tensor_parallel_group(group)
        if not next(gpt.parameters()).is_meta:  # meta init draws after sharding (spec.init_weights)
            gpt.init_weights_tp_invariant(dist.get_rank(group))
    if cp > 1:
        group = mesh["cp"].get_group()
        ranks = dist.get_process_group_ranks(group)
        stream = torch.cuda.Stream()  # TE overlaps the ring's KV exchange with attention on it
        for layer in gpt.layers:
            layer.set_context_parallel_group(group, ranks, stream, "p2p")



def tp_group_of(model) -> Optional[object]:
    """The tp group `wire_parallel` gave a TEGPT inside `model`, or None."""
    for module in model.modules():
        if isinstance(module, TEGPT):
            return module.tp_group
    return None


@torch.no_grad()
def init_te_model(model: nn.Module, std: float, out_std: float, generator: Optional[torch.Generator] = None,
                  tp_rank: int = 0, tp: int = 1) -> None:
    """Re-initialize a TE model's parameters in place, module by module in a fixed order.

    1-D tensors: biases zeros, norm gains ones. Matrices: N(0, out_std) for the residual output
    projections (attention `proj.weight`, MLP `fc2_weight`), N(0, std) otherwise. In-place ops
    work on real, materialized-meta and DTensor parameters. FP8 primary weights (TE
    QuantizedTensor, from quantized_model_init) cannot be written in place; their module's own
    `reset_parameters()` re-quantizes them from its init_method. That replaces the Parameter
    objects, so call this before the optimizer is built.

    With a `generator` (te_gpt under tp), TE's tensor-parallel shards are drawn at their full
    (tp=1) shape and sliced (models/te_parallel.tp_slice): the values do not depend on tp.
    """
    te = te_module()
    for module_name, module in model.named_modules():
        quantized = False
        for name, param in module.named_parameters(recurse=False):
            local = getattr(param, "_local_tensor", param)  # DTensor -> local shard
            if isinstance(local, te.QuantizedTensor):
                quantized = True
            elif param.ndim == 1:
                (nn.init.zeros_ if "bias" in name else nn.init.ones_)(param)
            else:
                out = name == "fc2_weight" or (module_name.endswith("proj") and name == "weight")
                _normal(param, name, out_std if out else std, generator, tp_rank, tp)
        if quantized:
            module.reset_parameters()


def _normal(param: torch.Tensor, name: str, std: float, generator: Optional[torch.Generator], tp_rank: int,
            tp: int) -> None:
    if generator is None:
        nn.init.normal_(param, mean=0.0, std=std)
        return
    from .te_parallel import is_tp_sharded, tp_slice

    if tp == 1 or not is_tp_sharded(param):
        param.normal_(mean=0.0, std=std, generator=generator)
        return
    dim = param.partition_dim
    shape = list(param.shape)
    shape[dim] *= tp
    full = torch.empty(shape, dtype=param.dtype, device=param.device).normal_(mean=0.0, std=std, generator=generator)
    param.copy_(tp_slice(full, name, dim, tp_rank, tp))
