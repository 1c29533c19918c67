"""The experts' FP8 grouped GEMM's layout (models/llama/moe_fp8.py) on the CPU: every expert's
group padded to a multiple of 16 rows (16 at least) in a buffer sized by the token count alone,
the last group taking the slack, and through it the experts give the loop's outputs and gradients
(a high-precision grouped GEMM stands in for torchao's FP8 kernel, which needs a GPU:
tests/gpu/test_moe_gpu.py)."""

import pytest

torch = pytest.importorskip("torch")

from mfsdp_launch.models.llama import moe, moe_fp8  # noqa: E402


def _grouped_mm(a, w, ends):
    """a's groups (ending at `ends`) times their expert's w[e]^T, in fp32: the FP8 kernel's contract."""
    assert a.shape[0] == int(ends[-1]) and all(int(e) % moe_fp8.ALIGN == 0 for e in ends)
    out, start = [], 0
    for e, end in enumerate(ends.tolist()):
        out.append(a[start:end] @ w[e].T)
        start = end
    return torch.cat(out)


def test_groups_are_padded_to_16_rows_in_a_buffer_sized_by_the_tokens():
    counts = torch.tensor([3, 0, 17, 16, 1])
    x = torch.arange(37, dtype=torch.float32)[:, None].repeat(1, 4) + 1
    padded, rows, ends = moe_fp8.pad_groups(x, counts)
    assert padded.shape == (moe_fp8.padded_rows(37, 5), 4) == (128, 4)
    assert ends.dtype == torch.int32 and ends.tolist() == [16, 32, 64, 80, 128]
    assert torch.equal(padded[rows], x)  # every row where its index says
    assert padded.abs().sum() == x.abs().sum()  # and nothing else but zeros
    starts = [0, 16, 32, 64, 80]
    assert [int(r) for r in rows[[0, 3, 20, 36]]] == [starts[0], starts[2], starts[3], starts[4]]


@pytest.mark.parametrize("counts", [[5, 0, 17, 3, 40, 1, 0, 9], [0, 0, 0, 64, 0, 0, 0, 0], [16] * 8])
def test_through_the_padded_layout_the_experts_are_the_loop(counts):
    torch.manual_seed(0)
    counts = torch.tensor(counts)
    E, dim, ffn = 8, 32, 48
    x = torch.randn(int(counts.sum()), dim, requires_grad=True)
    w1 = (0.1 * torch.randn(E, 2 * ffn, dim)).requires_grad_()
    w2 = (0.1 * torch.randn(E, dim, ffn)).requires_grad_()
    got = moe_fp8.run_fp8(x, counts, w1, w2, moe._swiglu, mm=_grouped_mm)
    want = moe._loop(x, counts, w1, w2)
    assert torch.allclose(got, want, atol=1e-6)
    g = torch.randn_like(want)
    for a, b in zip(torch.autograd.grad(got, (x, w1, w2), g), torch.autograd.grad(want, (x, w1, w2), g)):
        assert torch.allclose(a, b, atol=1e-6)


def test_it_applies_on_cuda_in_bf16_only():
    x, w1, w2 = torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(2, 192, 64), torch.zeros(2, 64, 96)
    assert not moe_fp8.fp8_applies(x, w1.bfloat16(), w2.bfloat16())  # the CPU: the loop runs
