"""One GPU: fp8.recipe=fused_rowwise's kernels and linear (components/fp8_casts.py, fp8_linear.py)
on the hardware's own FP8 conversion and GEMMs.

* the casts equal their plain-torch form bit for bit, at the 8B slice's widest shape too;
* the linear's output and gradients equal torchao's rowwise Float8Linear's (the same numerics:
  the same FP8 operands, so only the GEMMs' summation order may differ);
* compiled (the casts a custom op inside the graph) it gives what it gives eagerly.
"""

from __future__ import annotations

import pytest

from _harness import require_gpus

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _fp8_gpu():
    require_gpus(1)
    import torch

    pytest.importorskip("triton")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9+")


def _same(a, b) -> bool:
    import torch

    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


@pytest.mark.parametrize("shape", [(8192, 14336), (1000, 4104), (33, 70)])
def test_the_casts_equal_their_torch_form_bit_for_bit(shape):
    import torch

    from mfsdp_launch.components.fp8_casts import launch_casts, reference_casts

    torch.manual_seed(0)
    x = (torch.randn(*shape, device="cuda") * torch.logspace(-3, 3, shape[1], device="cuda")).bfloat16()
    x[1] = 0
    x[2, : shape[1] // 2] = -1e-30
    got, want = launch_casts(x), reference_casts(x)
    assert [_same(g, w) for g, w in zip(got, want)] == [True] * 4


def _layer_pair(K=4096, N=6144, M=8192):
    import torch

    from mfsdp_launch.components import fp8_linear

    torch.manual_seed(0)
    ours = torch.nn.Linear(K, N, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(2, M // 2, K, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(2, M // 2, N, device="cuda", dtype=torch.bfloat16)
    fp8_linear.convert([ours])
    return ours, x, dy


def _grads(layer, x, dy, forward=None):
    x = x.clone().requires_grad_(True)
    layer.weight.grad = None
    y = (forward or layer)(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad.clone()


def test_the_linear_equals_torchaos_rowwise_float8_linear():
    import torch

    pytest.importorskip("torchao.float8")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    ours, x, dy = _layer_pair()
    theirs = torch.nn.Sequential(torch.nn.Linear(4096, 6144, bias=False, device="cuda", dtype=torch.bfloat16))
    theirs[0].weight.data.copy_(ours.weight.data)
    convert_to_float8_training(theirs, config=Float8LinearConfig.from_recipe_name("rowwise"))
    rel = lambda a, b: ((a.float() - b.float()).norm() / b.float().norm()).item()
    got, want = _grads(ours, x, dy), _grads(theirs[0], x, dy)
    diffs = [rel(g, w) for g, w in zip(got, want)]
    bf16 = _grads(_plain(ours.weight.data), x, dy)
    print(f"fused_rowwise vs torchao rowwise (y, dx, dW): {['%.2e' % d for d in diffs]}; "
          f"vs bf16: {['%.2e' % rel(g, w) for g, w in zip(got, bf16)]}")
    # The same FP8 operands and GEMM settings (session 31 before fast accumulation in forward:
    # y 2.28e-3 apart, dx and dW equal). torchao's casts can pick the other power of two where
    # 448/amax rounds across one (exp2(floor(log2)) in float32): a little room.
    assert max(diffs) < 1e-3, diffs


def _plain(weight):
    import torch

    layer = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="cuda", dtype=torch.bfloat16)
    layer.weight.data.copy_(weight)
    return layer


def test_compiled_the_linear_gives_what_it_gives_eagerly():
    import torch

    ours, x, dy = _layer_pair(K=1024, N=2048, M=4096)
    step = lambda t: torch.nn.functional.silu(ours(t))  # noqa: E731
    eager, compiled = _grads(ours, x, dy, forward=step), _grads(ours, x, dy, forward=torch.compile(step))
    rel = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(compiled, eager)]
    print(f"compiled vs eager (y, dx, dW): {['%.2e' % r for r in rel]}")
    # The FP8 GEMMs and casts are the same kernels; Inductor's SiLU may round otherwise than eager's.
    assert max(rel) < 5e-3, rel
