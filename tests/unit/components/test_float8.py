"""torchao float8 training without TE (components/float8.py), on the CPU through torchao's
emulation (the real FP8 GEMMs need a GPU: tests/gpu/test_every_tool_gpu.py): which Linears convert,
fp8.skip and odd dimensions keep high precision, gpt's own init survives the swap, and an
emulated step lands near the high-precision one."""

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao.float8")

from helpers import model_cfg  # noqa: E402
from mfsdp_launch.components import float8  # noqa: E402
from mfsdp_launch.core.schema import FP8Config  # noqa: E402
from mfsdp_launch.models import build_model_spec  # noqa: E402


def _gpt():
    spec = build_model_spec(model_cfg("gpt", preset="tiny", n_layers=2), 32)
    torch.manual_seed(0)
    return spec, spec.build()


def test_convert_keeps_skipped_and_odd_layers_and_gpts_init():
    from torchao.float8.float8_linear import Float8Linear

    spec, model = _gpt()
    model.odd = torch.nn.Linear(64, 24, bias=False)  # 24 is not a multiple of 16
    kept = float8.convert(model, FP8Config(recipe="torchao_rowwise", skip=["lm_head"]))
    assert sorted(kept) == ["lm_head", "odd"]
    converted = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    assert len(converted) == 8 and all(n.startswith("layers.") for n in converted)  # wqkv, wo, w_gate_up, w_down x 2
    layer = model.get_submodule(converted[0])
    layer.reset_parameters()  # gpt's N(0, init_std), not nn.Linear's kaiming
    assert abs(layer.weight.std().item() - layer.init_std) < 0.3 * layer.init_std


def test_the_head_outside_the_units_is_found_and_compiled_with_them(monkeypatch):
    """train.compile compiles the blocks; a converted head outside them is compiled on its own, or
    its FP8 casts run as eager kernels over [tokens, vocab] tensors."""
    import torch._inductor.config as inductor

    from mfsdp_launch.models.activation_checkpoint import outermost_units
    from mfsdp_launch.models.compile import compile_model

    monkeypatch.setattr(inductor, "emulate_precision_casts", False)
    spec, model = _gpt()
    float8.convert(model, FP8Config(recipe="torchao_rowwise"))
    assert inductor.emulate_precision_casts  # rowwise: compiled casts round as eager (float8.py says why)
    outside = float8.outside(model, outermost_units(model, spec.unit_modules))
    assert outside == [model.lm_head]
    _, line = compile_model(model, spec.unit_modules, also=outside)
    assert "forward" in vars(model.lm_head) and "2 Block unit(s)" in line and "1 Float8Linear outside them" in line
    _, model = _gpt()
    float8.convert(model, FP8Config(recipe="torchao_tensorwise", skip=["lm_head"]))
    assert float8.outside(model, outermost_units(model, spec.unit_modules)) == []  # a head kept in bf16: nothing to add


@pytest.mark.parametrize("recipe", ["torchao_tensorwise", "torchao_rowwise"])
def test_an_emulated_step_is_close_to_high_precision(recipe):
    spec, plain = _gpt()
    _, model = _gpt()
    float8.convert(model, FP8Config(recipe=recipe), emulate=True)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    want, got = spec.loss(plain, batch), spec.loss(model, batch)
    got.backward()
    assert got.item() == pytest.approx(want.item(), rel=0.02)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_convert_turns_on_the_experts_fp8_grouped_gemm_where_it_applies():
    from mfsdp_launch.models.llama.moe import GroupedExperts

    def experts(**moe):
        spec = build_model_spec(model_cfg("gpt", preset="tiny_moe", moe=moe or None), 32)
        model = spec.build()
        return model, {n: m for n, m in model.named_modules() if isinstance(m, GroupedExperts)}

    model, found = experts()
    assert len(found) == 2 and not any(m.fp8 for m in found.values())
    assert float8.convert(model, FP8Config(recipe="torchao_rowwise", skip=["lm_head"])) == ["lm_head"]
    assert all(m.fp8 for m in found.values())
    model, found = experts()
    kept = float8.convert(model, FP8Config(recipe="torchao_tensorwise", skip=["layers.0.mlp.experts"]))
    assert kept == ["layers.0.mlp.experts"] and [m.fp8 for m in found.values()] == [False, True]
    model, found = experts(ffn_dim=40)  # not a multiple of 16
    assert float8.convert(model, FP8Config(recipe="torchao_rowwise")) == ["layers.0.mlp.experts", "layers.1.mlp.experts"]
    assert not any(m.fp8 for m in found.values())
