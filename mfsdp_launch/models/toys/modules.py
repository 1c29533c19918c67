"""The seed test's toy models (Megatron-FSDP's test_fully_shard), copied verbatim, plus what the
launcher needs to train them: builders, FSDP unit modules, synthetic batches, loss and re-init.

Seed semantics: input and target are `torch.randn(1, DIM_SIZE, DIM_SIZE)` drawn in that order,
the loss is MSE, and ToyTransformer is called as `model(x, x)`.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch.nn.functional import mse_loss



class ToyCNN(torch.nn.Module):
    """Toy CNN model for testing Megatron-FSDP sharding for high-rank Tensor parameters and inputs."""

    def __init__(
        self,
        channels: int = 3,
        height: int = 10,
        width: int = 10,
        kernel_size: int = 3,
        output_dim: int = 10,
        bias: bool = True,
        num_layers: int = 1,
    ):
        super().__init__()
        self.channels = channels
        self.height = height
        self.width = width
        self.kernel_size = kernel_size
        self.output_dim = output_dim
        self.bias = bias
        self.num_layers = num_layers
        self.cnn_layers = torch.nn.ModuleList(
            [
                torch.nn.Conv2d(channels, channels, kernel_size, padding="same", bias=bias)
                for _ in range(num_layers)
            ]
        )
        self.dense = torch.nn.Linear(channels, 1, bias)

    def forward(self, x: torch.Tensor):
        """Toy forward pass for the CNN, where input and output shapes match."""
        x = x.broadcast_to(1, self.channels, self.height, self.width)
        for layer in self.cnn_layers:
            x = layer(x)
        x = x.transpose(1, 2).transpose(2, 3)
        x = self.dense(x).reshape(1, self.height, self.width)
        return x


class ToyTransformer(torch.nn.Module):
    """Toy Transformer model for testing Megatron-FSDP."""

    def __init__(self, model_dim, num_heads, num_layers, output_dim):
        super().__init__()
        self.transformer = torch.nn.Transformer(
            d_model=model_dim,
            nhead=num_heads,
            num_encoder_layers=num_layers,
            num_decoder_layers=num_layers,
        )
        self.fc_out = torch.nn.Linear(model_dim, output_dim)

    def forward(self, x, y):
        x = self.transformer(x, y)
        x = self.fc_out(x)
        return x


# FSDP unit modules, as in the seed's build_toy_model.
TOY_UNIT_MODULES = {
    "toy_cnn": (torch.nn.Conv2d, torch.nn.Linear),
    "toy_transformer": (torch.nn.Transformer,),
}


def toy_batch(
    generator: torch.Generator,
    shape: tuple[int, ...],
    device: torch.device,
    dtype: Optional[torch.dtype] = None,
) -> dict:
    """Input then target, both `randn(shape)`, drawn in the seed's order on the generator's own
    device and then moved, so a CPU generator reproduces the seed's `randn(...).to("cuda")`."""
    kw = {"generator": generator, "device": generator.device}
    if dtype is not None:
        kw["dtype"] = dtype
    x = torch.randn(*shape, **kw)
    y = torch.randn(*shape, **kw)
    return {"x": x.to(device), "y": y.to(device)}


def toy_loss(two_inputs: bool) -> Callable[[torch.nn.Module, dict], torch.Tensor]:
    """MSE of model(x) (or model(x, x) for ToyTransformer) against y."""

    def loss(model: torch.nn.Module, batch: dict) -> torch.Tensor:
        x = batch["x"]
        out = model(x, x) if two_inputs else model(x)
        return mse_loss(out, batch["y"])

    return loss


@torch.no_grad()
def reset_module_parameters(model: torch.nn.Module) -> None:
    """Re-run each submodule's own init, children before parents.

    Order matters for nn.Transformer: its `_reset_parameters` (xavier on every matrix) runs last
    in its constructor, after its layers' own inits; visiting modules in reverse pre-order puts
    every descendant before its ancestors, which reproduces that. All torch inits are in-place,
    so this also works on materialized meta and DTensor parameters.
    """
    for module in reversed(list(model.modules())):
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
        elif hasattr(module, "_reset_parameters"):
            module._reset_parameters()
