"""Families `toy_cnn`, `toy_transformer`, `te_toy_transformer`: the seed test's toy models
(models/toys/modules.py, te_modules.py) on their fixed synthetic (input, target) pair.

Dimensions follow the seed (DIM_SIZE=2, NUM_LAYERS=2, 2 heads); the TE toy defaults to the seed's
quantized test (model_dim=64), since FP8 GEMMs need dims divisible by 16. The seed builds their
meshes with tp/cp > 1 and every rank of a TP/CP group sees the same batch, so they accept them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from ...core.errors import ConfigError
from .config import ToyModelConfig
from ..family import ModelContext, ModelFamily, ModelSpec, Parallel, find_module

CNN_CHANNELS = 3
CNN_KERNEL = 3
TORCH_TRANSFORMER_FFN = 2048  # torch.nn.Transformer's default dim_feedforward


@dataclass(frozen=True)
class ToyDims:
    dim: int
    n_layers: int
    n_heads: int
    output_dim: int


class ToyFamily(ModelFamily):
    section = ToyModelConfig
    uses_tokens = False
    tp_mode = Parallel.REPLICATE
    cp_mode = Parallel.REPLICATE
    default_dim = 2

    def dims(self, m) -> ToyDims:
        dim = m.dim if m.dim is not None else self.default_dim
        d = ToyDims(dim=int(dim), n_layers=int(m.n_layers if m.n_layers is not None else 2),
                    n_heads=int(m.n_heads if m.n_heads is not None else 2),
                    output_dim=int(m.output_dim if m.output_dim is not None else dim))
        for key in ("dim", "n_layers", "n_heads", "output_dim"):
            if getattr(d, key) <= 0:
                raise ConfigError(f"model.{key}", f"must be positive, got {getattr(d, key)}")
        if self.attention and d.dim % d.n_heads:
            raise ConfigError("model.dim", f"{d.dim} is not divisible by n_heads={d.n_heads}")
        return d

    def check(self, m, ctx: ModelContext) -> List[str]:
        self.dims(m)
        if ctx.data_name != "synthetic":
            raise ConfigError("data", f"model={self.name} trains on synthetic inputs, as the seed does",
                              "synthetic")
        return []

    def n_heads(self, m):
        return self.dims(m).n_heads if self.attention else None

    def shape(self, m) -> dict:
        return {"dim": self.dims(m).dim, "n_layers": self.dims(m).n_layers, "n_heads": self.dims(m).n_heads,
                "output_dim": self.dims(m).output_dim}

    def flops_per_token(self, m, seq_len: int) -> float:
        """Per sample (tokens_per_sample is 1): 6 * N_matmul times the positions each weight is
        applied to. Attention terms are left out (seq 1, or unknown for the TE toy): a lower bound."""
        return float(6 * self.matmul_params(m) * self.positions(m))

    def _toy_spec(self, m, *, build, unit_modules, loss, init_weights, batch_shape, dtype) -> ModelSpec:
        from .modules import toy_batch

        return ModelSpec(name=self.name, build=build, unit_modules=unit_modules, loss=loss,
                         init_weights=init_weights, uses_tokens=False,
                         synthetic_batch=lambda gen, mbs, device: toy_batch(gen, batch_shape(mbs), device, dtype),
                         tokens_per_sample=1, num_params=self.param_count(m),
                         flops_per_token=self.flops_per_token(m, 1))


class ToyCNNFamily(ToyFamily):
    name = "toy_cnn"
    attention = False

    def param_count(self, m) -> int:
        c, k = CNN_CHANNELS, CNN_KERNEL
        return self.dims(m).n_layers * (c * c * k * k + c) + (c + 1)

    def matmul_params(self, m) -> int:
        return self.dims(m).n_layers * CNN_CHANNELS ** 2 * CNN_KERNEL ** 2 + CNN_CHANNELS

    def positions(self, m) -> int:
        return self.dims(m).dim ** 2  # H = W = dim ("same" padding counted as full)

    def largest_unit_params(self, m) -> int:  # units: each Conv2d and the dense Linear
        c, k = CNN_CHANNELS, CNN_KERNEL
        return max(c * c * k * k + c, c + 1)

    def activation_bytes(self, m, micro_batch_size: int, seq_len: int, bytes_per_el: int) -> int:
        d = self.dims(m)  # input broadcast to (1, 3, dim, dim): each conv and the head keep one map
        return (d.n_layers + 2) * CNN_CHANNELS * d.dim * d.dim * bytes_per_el

    def spec(self, m, seq_len: int) -> ModelSpec:
        from ...components.precision import torch_dtype
        from . import modules as T

        d, dtype = self.dims(m), torch_dtype(m.params_dtype)

        def build():
            model = T.ToyCNN(channels=CNN_CHANNELS, height=d.dim, width=d.dim, kernel_size=CNN_KERNEL,
                             output_dim=d.output_dim, bias=True, num_layers=d.n_layers)
            return model.to(dtype) if dtype is not None else model

        # The seed's shape is fixed at (1, dim, dim): micro_batch_size is ignored.
        return self._toy_spec(m, build=build, unit_modules=T.TOY_UNIT_MODULES["toy_cnn"],
                              loss=T.toy_loss(two_inputs=False), dtype=dtype,
                              init_weights=lambda model: T.reset_module_parameters(find_module(model, T.ToyCNN)),
                              batch_shape=lambda mbs: (1, d.dim, d.dim))


def torch_transformer_params(d: int, n_layers: int) -> int:
    """torch.nn.Transformer(d_model=d, num_encoder_layers=num_decoder_layers=n_layers)."""
    ffn = TORCH_TRANSFORMER_FFN
    mha = 4 * d * d + 4 * d  # in_proj (3d x d + 3d) and out_proj (d x d + d)
    ffn_params = 2 * d * ffn + ffn + d
    encoder_layer = mha + ffn_params + 2 * 2 * d  # two LayerNorms
    decoder_layer = 2 * mha + ffn_params + 3 * 2 * d  # self + cross attention, three LayerNorms
    return n_layers * (encoder_layer + decoder_layer) + 2 * 2 * d  # + encoder.norm, decoder.norm


class ToyTransformerFamily(ToyFamily):
    name = "toy_transformer"

    def head_params(self, m) -> int:
        d = self.dims(m)
        return d.dim * d.output_dim + d.output_dim

    def param_count(self, m) -> int:
        d = self.dims(m)
        return torch_transformer_params(d.dim, d.n_layers) + self.head_params(m)

    def matmul_params(self, m) -> int:
        d, ffn = self.dims(m), TORCH_TRANSFORMER_FFN
        enc = 4 * d.dim ** 2 + 2 * d.dim * ffn
        dec = 8 * d.dim ** 2 + 2 * d.dim * ffn
        return d.n_layers * (enc + dec) + d.dim * d.output_dim

    def positions(self, m) -> int:
        return self.dims(m).dim  # the seed's input is seq 1 x batch dim

    def largest_unit_params(self, m) -> int:  # units: the nn.Transformer; root: fc_out
        d = self.dims(m)
        return max(torch_transformer_params(d.dim, d.n_layers), self.head_params(m))

    def activation_bytes(self, m, micro_batch_size: int, seq_len: int, bytes_per_el: int) -> int:
        d = self.dims(m)
        per_layer = 2 * TORCH_TRANSFORMER_FFN + 12 * d.dim  # the FFN hidden (pre/post ReLU) dominates
        return d.dim * 3 * d.n_layers * per_layer * bytes_per_el  # encoder + 2x decoder blocks

    def spec(self, m, seq_len: int) -> ModelSpec:
        from ...components.precision import torch_dtype
        from . import modules as T

        d, dtype = self.dims(m), torch_dtype(m.params_dtype)

        def build():
            model = T.ToyTransformer(model_dim=d.dim, num_heads=d.n_heads, num_layers=d.n_layers,
                                     output_dim=d.output_dim)
            return model.to(dtype) if dtype is not None else model

        # nn.Transformer reads the seed's (1, dim, dim) input as seq 1 x batch dim.
        return self._toy_spec(m, build=build, unit_modules=T.TOY_UNIT_MODULES["toy_transformer"],
                              loss=T.toy_loss(two_inputs=True), dtype=dtype,
                              init_weights=lambda model: T.reset_module_parameters(
                                  find_module(model, T.ToyTransformer)),
                              batch_shape=lambda mbs: (1, d.dim, d.dim))


class TEToyTransformerFamily(ToyTransformerFamily):
    name = "te_toy_transformer"
    has_te_layers = True
    default_dim = 64

    def shape(self, m) -> dict:
        # model.fuse_qkv is recorded with every TE family's shape (a checkpoint's QKV layout).
        return {**super().shape(m), "fuse_qkv": bool(getattr(m, "fuse_qkv", False))}

    @staticmethod
    def layer_params(dim: int) -> int:
        """te.TransformerLayer(hidden=ffn=d), TE defaults (LayerNorm, gelu, bias): qkv LN(2d) +
        3d*d + 3d; proj d*d + d; mlp LN(2d) + 2 * (d*d + d)."""
        return 6 * dim * dim + 10 * dim

    def param_count(self, m) -> int:
        d = self.dims(m)
        return d.n_layers * self.layer_params(d.dim) + self.head_params(m)

    def matmul_params(self, m) -> int:
        d = self.dims(m)
        return d.n_layers * 6 * d.dim * d.dim + d.dim * d.output_dim

    def matmuls(self, m, seq_len: int, linears=None):
        """Every matmul its FLOPs count is a TE linear (the attention core is left out of them)."""
        from ...core.fp8_flops import TE_LAYER, Matmul

        d, n = self.dims(m), 6.0 * self.positions(m)
        parts = [(f"layers.{i}.{name}", k * d.dim * d.dim) for i in range(d.n_layers)
                 for name, k in (("self_attention.layernorm_qkv", 3), ("self_attention.proj", 1), ("layernorm_mlp", 2))]
        return [Matmul(name, n * w, TE_LAYER) for name, w in parts + [("fc_out", d.dim * d.output_dim)]]

    def largest_unit_params(self, m) -> int:  # TransformerLayer, te.Linear fc_out
        return max(self.layer_params(self.dims(m).dim), self.head_params(m))

    def activation_bytes(self, m, micro_batch_size: int, seq_len: int, bytes_per_el: int) -> int:
        d = self.dims(m)  # input (mbs, dim, dim) in [s, b, h]: mbs * dim tokens
        return micro_batch_size * d.dim * d.n_layers * 16 * d.dim * bytes_per_el

    def resolve(self, m, compute_dtype) -> None:
        if m.params_dtype is None:  # TE layers compute in their parameters' dtype
            m.params_dtype = compute_dtype

    def spec(self, m, seq_len: int) -> ModelSpec:
        from ...components.precision import torch_dtype
        from ..llama import te_modules
        from . import modules as T

        import torch

        te = te_modules.te_module(self.name)
        d, dtype = self.dims(m), torch_dtype(m.params_dtype) or torch.float32  # the seed's default

        def build():
            return te_modules.ToyTETransformer(model_dim=d.dim, num_heads=d.n_heads, num_layers=d.n_layers,
                                               output_dim=d.output_dim, fuse_qkv_params=bool(m.fuse_qkv),
                                               params_dtype=dtype, device=te_modules.te_device())

        # TE's default init (N(0, 0.023), norms ones, biases zeros), as the constructor does.
        std = te_modules.TE_DEFAULT_INIT_STD
        # Seed: randn(16, 64, 64) in params dtype, [s, b, h] with s = micro_batch_size.
        return self._toy_spec(m, build=build, unit_modules=(te.TransformerLayer, te.Linear),
                              loss=T.toy_loss(two_inputs=False), dtype=dtype,
                              init_weights=lambda model: te_modules.init_te_model(
                                  find_module(model, te_modules.ToyTETransformer), std=std, out_std=std),
                              batch_shape=lambda mbs: (mbs, d.dim, d.dim))


FAMILIES = (ToyCNNFamily(), ToyTransformerFamily(), TEToyTransformerFamily())
