"""fp8.recipe=fused_rowwise on the CPU: the cast kernels (components/fp8_casts.py) in Triton's
interpreter against the same casts in plain torch, bit for bit; the FP8 linear
(components/fp8_linear.py) forward and backward against its math done in fp32 on the dequantized
casts (CPU torch._scaled_mm runs the real FP8 GEMM); the conversion of a gpt; the custom op's
fake kernel (what torch.compile traces). The GPU runs it compiled: tests/gpu/test_every_tool_gpu.py."""

import textwrap

import pytest

from helpers import interpreted

_SCRIPT = textwrap.dedent("""
    import json, torch
    from mfsdp_launch.components import fp8_casts, fp8_linear, float8
    from mfsdp_launch.core.schema import FP8Config
    torch.manual_seed(0)
    out = {}

    def same(a, b):
        if a.dtype == torch.float8_e4m3fn:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)

    # (33, 70): both axes cross the interpreter's 16 x 32 tiles with a ragged edge.
    x = (torch.randn(33, 70) * torch.logspace(-4, 4, 70)).to(torch.bfloat16)
    x[3] = 0                                  # a zero row: the amax floor, +0 out
    x[5, :10] = -1e-30                        # values that round to -0
    x[7, 11] = 3e38                           # near bf16's max
    wide = torch.randn(40, 96)                # fp32 input; a row-strided view (stride 96, 64 columns)
    cases = {"bf16": x, "fp32_view": wide[:, 16:80]}
    out["casts"] = {k: [same(a, b) for a, b in zip(fp8_casts.launch_casts(t), fp8_casts.reference_casts(t))]
                    for k, t in cases.items()}

    # The linear: forward and both gradients against the same math on the dequantized casts.
    M, K, N = 48, 64, 80
    xin = torch.randn(2, M // 2, K, requires_grad=True)
    w = (torch.randn(N, K) * 0.05).requires_grad_(True)
    b = torch.randn(N, requires_grad=True)
    dy = torch.randn(2, M // 2, N)
    y = fp8_linear.fp8_linear(xin, w, b)
    y.backward(dy)

    def deq_rows(t):   # t scaled per row, dequantized
        q, inv, _, _ = fp8_casts.reference_casts(t)
        return q.float() * inv[:, None]

    def deq_cols(t):   # t scaled per column, dequantized
        _, _, qt, inv = fp8_casts.reference_casts(t)
        return (qt.float() * inv[:, None]).t()

    # The matmul returns bf16, so its backward receives dy rounded to bf16.
    x2, d2 = xin.detach().reshape(M, K), dy.reshape(M, N).bfloat16()
    want_y = (deq_rows(x2) @ deq_rows(w.detach()).t()).bfloat16().float() + b.detach()
    want_dx = (deq_rows(d2) @ deq_cols(w.detach())).bfloat16().float()
    want_dw = (deq_cols(d2).t() @ deq_cols(x2)).bfloat16().float()
    rel = lambda a, c: ((a.float() - c.float()).norm() / c.float().norm()).item()
    out["linear_vs_fp8_math"] = [rel(y.reshape(M, N), want_y), rel(xin.grad.reshape(M, K), want_dx),
                                 rel(w.grad, want_dw), rel(b.grad, dy.reshape(M, N).sum(0))]
    xr, wr = xin.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    torch.nn.functional.linear(xr, wr).backward(dy)
    out["linear_vs_fp32"] = [rel(xin.grad, xr.grad), rel(w.grad, wr.grad)]
    odd = torch.randn(3, 5, K)                # 15 tokens: not a multiple of 16, high precision
    out["odd_tokens_exact"] = torch.equal(fp8_linear.fp8_linear(odd, w.detach()),
                                          torch.nn.functional.linear(odd, w.detach()))

    # The fake kernel torch.compile traces agrees with the real one (shapes, dtypes, strides).
    torch.library.opcheck(fp8_casts.casts_op(), (torch.randn(32, 48, dtype=torch.bfloat16),),
                          test_utils=("test_schema", "test_faketensor"))
    out["opcheck"] = True
    print(json.dumps(out))
""")


def test_casts_and_the_fp8_linear_match_their_plain_torch_math():
    out = interpreted(_SCRIPT)
    assert out["casts"] == {"bf16": [True] * 4, "fp32_view": [True] * 4}
    # The same FP8 products summed in fp32 either way; what differs is the order of the sums.
    assert max(out["linear_vs_fp8_math"]) < 1e-5, out["linear_vs_fp8_math"]
    # E4M3 (3 mantissa bits) on both operands: a few percent from the fp32 linear.
    assert max(out["linear_vs_fp32"]) < 0.08, out["linear_vs_fp32"]
    assert out["odd_tokens_exact"] and out["opcheck"]


_CONVERT = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, "tests")
    from helpers import model_cfg
    from mfsdp_launch.components import float8
    from mfsdp_launch.core.schema import FP8Config
    from mfsdp_launch.models import build_model_spec

    def gpt():
        spec = build_model_spec(model_cfg("gpt", preset="tiny", n_layers=2), 32)
        torch.manual_seed(0)
        return spec, spec.build()

    spec, plain = gpt()
    _, model = gpt()
    keys = list(model.state_dict())
    model.odd = torch.nn.Linear(64, 24, bias=False)
    kept = float8.convert(model, FP8Config(recipe="fused_rowwise", skip=["lm_head"]))
    del model.odd
    converted = sorted(n for n, m in model.named_modules() if type(m).__name__.startswith("RowwiseFP8"))
    layer = model.get_submodule(converted[0])
    layer.reset_parameters()
    init_ok = abs(layer.weight.std().item() - layer.init_std) < 0.3 * layer.init_std
    _, model = gpt()
    float8.convert(model, FP8Config(recipe="fused_rowwise"))
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    want, got = spec.loss(plain, batch), spec.loss(model, batch)
    got.backward()
    print(json.dumps(dict(kept=sorted(kept), converted=converted, init_ok=init_ok, keys=keys == list(model.state_dict()),
                          isinstance=all(isinstance(model.get_submodule(n), torch.nn.Linear) for n in converted),
                          loss=[want.item(), got.item()],
                          finite=all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))))
""")


def test_convert_turns_a_gpts_linears_into_fp8_and_a_step_stays_near_high_precision():
    out = interpreted(_CONVERT)
    assert out["kept"] == ["lm_head", "odd"]
    assert len(out["converted"]) == 8 and all(n.startswith("layers.") for n in out["converted"])
    assert out["init_ok"] and out["keys"] and out["isinstance"] and out["finite"]
    want, got = out["loss"]
    assert got == pytest.approx(want, rel=0.02)


# Scripts that count the casts launched: `calls[0]`.
_COUNTING = textwrap.dedent("""
    import json, torch, torch.nn as nn
    from mfsdp_launch.components import fp8_casts, fp8_linear
    calls = [0]
    real = fp8_casts.launch_casts

    def counted(x):
        calls[0] += 1
        return real(x)

    fp8_linear.launch_casts = fp8_casts.launch_casts = counted
""")

_COMPILED = _COUNTING + textwrap.dedent("""

    class QKV(nn.Module):   # three projections of one input, as a Hugging Face attention's
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(64, n, bias=False) for n in (64, 32, 48))

        def forward(self, x):
            return self.q(x).sum(-1) + self.k(x).sum(-1) + self.v(x).sum(-1)

    m = QKV()
    fp8_linear.convert([m.q, m.k, m.v])
    x = torch.randn(2, 16, 64, requires_grad=True)
    explained = torch._dynamo.explain(m)(x)
    torch._dynamo.reset()
    calls[0] = 0
    y = torch.compile(m, backend="aot_eager")(x)
    forward = calls[0]
    y.sum().backward()
    print(json.dumps(dict(breaks=explained.graph_break_count, graphs=explained.graph_count, forward=forward)))
""")


def test_compiled_the_casts_are_one_node_and_a_shared_input_is_cast_once():
    """torch.compile traces the linear whole (a graph break per call would split every block into
    eager pieces) and merges the casts of the input that q, k and v share."""
    out = interpreted(_COMPILED)
    assert out["breaks"] == 0 and out["graphs"] == 1, out
    assert out["forward"] == 4, out  # x once, each weight once


_CACHED = _COUNTING + textwrap.dedent("""
    from mfsdp_launch.components.fp8_linear import WeightCasts

    def model(cache):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(32, 48, bias=False), nn.ReLU(), nn.Linear(48, 16, bias=False))
        fp8_linear.convert([m[0], m[2]], cache_weight_casts=cache)
        return m

    def train(m, hook, compiled=False, steps=3, micro=2):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        fwd = torch.compile(m, backend="aot_eager") if compiled else m
        calls[0] = 0
        for step in range(steps):
            for i in range(micro):
                hook(i)
                x = torch.randn(16, 32, generator=torch.Generator().manual_seed(10 * step + i))
                fwd(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in m.parameters()], calls[0]

    fresh, fresh_calls = train(model(False), lambda i: None)
    cached, cached_calls = train(model(True), WeightCasts.before_micro_batch)
    compiled, _ = train(model(True), WeightCasts.before_micro_batch, compiled=True)
    # a run whose later steps never refill: the casts of the first step's weights, read on
    seen = [0]

    def never_again(i):
        WeightCasts.before_micro_batch(i + seen[0])
        seen[0] = 1

    stale, _ = train(model(True), never_again)
    m = model(True).to(dtype=torch.bfloat16)  # (as an engine casts a model: the casts' bits stay bits)
    buffers = sorted(name for name, _ in m.named_buffers())
    print(json.dumps(dict(
        cached=all(torch.equal(a, b) for a, b in zip(fresh, cached)),
        compiled=all(torch.equal(a, b) for a, b in zip(fresh, compiled)),
        stale=all(torch.equal(a, b) for a, b in zip(fresh, stale)),
        calls=[fresh_calls, cached_calls], buffers=buffers, state_dict=sorted(m.state_dict()),
        dtypes=sorted({str(b.dtype) for _, b in m.named_buffers()}))))
""")


def test_cached_weight_casts_train_as_fresh_ones_and_are_refilled_every_step():
    """fp8.cache_weight_casts: the first micro-batch of each step writes the casts, the others read
    them; eager and compiled, the weights end where casting every micro-batch leaves them. A run
    that never refills ends elsewhere (the cache is what the later micro-batches read)."""
    out = interpreted(_CACHED)
    assert out["cached"] and out["compiled"] and not out["stale"], out
    # 3 steps x 2 micro-batches: forward casts x and W of 2 layers, backward dy: 6 a micro-batch
    # fresh; cached, the weights' 2 only in each step's first micro-batch
    assert out["calls"] == [36, 36 - 3 * 2], out["calls"]
    assert out["buffers"] == sorted(f"{i}.fp8_weight_{n}" for i in (0, 2) for n in ("inv", "inv_t", "q", "qt"))
    assert out["state_dict"] == ["0.weight", "2.weight"]  # not checkpointed
    assert out["dtypes"] == ["torch.int32", "torch.uint8"]


_SHARED = _COUNTING + textwrap.dedent("""

    class QKV(nn.Module):   # q/k/v of one input, k with a bias (Qwen2's); `kv`: another input for k, v
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (nn.Linear(64, n, bias=b) for n, b in ((64, False), (32, True), (48, False)))

        def forward(self, x, kv=None):
            kv = x if kv is None else kv
            return self.q(x).sum(-1) + self.k(kv).sum(-1) * 2 + self.v(kv).sum(-1) * 3

    def make(group):
        torch.manual_seed(0)
        m = QKV()
        fp8_linear.convert([m.q, m.k, m.v], shared_inputs=[[m.q, m.k, m.v]] if group else ())
        return m

    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1))

    def run(m, compiled=False, kv=None):
        xi = x.clone().requires_grad_(True)
        f = torch.compile(m, backend="aot_eager") if compiled else m
        calls[0] = 0
        y = f(xi, kv)
        forward = calls[0]
        y.sum().backward()
        return y.detach(), xi.grad, [p.grad for p in m.parameters()], [forward, calls[0]]

    rel = lambda a, c: ((a.float() - c.float()).norm() / c.float().norm()).item()
    plain, grouped = run(make(False)), run(make(True))
    explained = torch._dynamo.explain(make(True))(x)
    torch._dynamo.reset()
    compiled = run(make(True), compiled=True)
    other = torch.randn(2, 16, 64)
    cross_grouped, cross_plain = run(make(True), kv=other), run(make(False), kv=other)
    held = make(True)
    held(x)
    group = held.q.fp8_shared_input[0]
    print(json.dumps(dict(
        y=rel(grouped[0], plain[0]), dx=rel(grouped[1], plain[1]), dw=[rel(a, b) for a, b in zip(grouped[2], plain[2])],
        calls=[plain[3], grouped[3], compiled[3]],
        compiled_equal=[torch.equal(a, b) for a, b in zip([compiled[0], compiled[1], *compiled[2]],
                                                          [grouped[0], grouped[1], *grouped[2]])],
        breaks=explained.graph_break_count, graphs=explained.graph_count,
        cross=[rel(a, b) for a, b in zip([cross_grouped[0], cross_grouped[1], *cross_grouped[2]],
                                          [cross_plain[0], cross_plain[1], *cross_plain[2]])],
        released=group.source is None and group.held == [None] * 3)))
""")


def test_linears_that_share_an_input_run_as_one_gemm():
    """q/k/v of one input as one FP8 layer over their concatenated weights: the forward and the
    weight gradients are each layer's own (the same row scales), the input gradient moves by the
    scales the group shares (gpt's fused wqkv numerics); two casts a forward instead of six
    eagerly (four compiled), no graph break, compiled equal to eager; a member called on another
    tensor (cross-attention) gets its own layer's result; nothing is held past the last member."""
    out = interpreted(_SHARED)
    assert out["y"] == 0.0 and out["dw"] == [0.0] * 4, out
    assert 0 < out["dx"] < 0.01, out
    assert out["calls"] == [[6, 9], [2, 3], [2, 3]], out
    assert out["breaks"] == 0 and out["graphs"] == 1 and all(out["compiled_equal"]), out
    assert out["cross"] == [0.0] * 6 and out["released"], out


_HF_SHARED = _COUNTING + textwrap.dedent("""
    from mfsdp_launch.components import float8
    from mfsdp_launch.core.schema import FP8Config
    from mfsdp_launch.models.hf import model as hf_model
    from mfsdp_launch.models.hf.tensor_parallel import shared_input_linears
    from mfsdp_launch.models.losses import cross_entropy_loss

    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    out = {}
    for arch in ("llama", "qwen2"):   # qwen2: q/k/v with biases
        src = hf_model.resolve_hf_model(hf_config=dict(model_type=arch, **tiny))
        runs = {}
        for grouped in (False, True):
            torch.manual_seed(0)
            model = hf_model.build_hf_model(src)
            groups = shared_input_linears(model) if grouped else []
            names = {id(m): n for n, m in model.named_modules()}
            float8.convert(model, FP8Config(recipe="fused_rowwise", skip=["lm_head"]), shared_inputs=groups)
            calls[0] = 0
            loss = cross_entropy_loss(model, batch)
            forward = calls[0]
            loss.backward()
            runs[grouped] = dict(loss=loss.item(), calls=[forward, calls[0]],
                                 groups=[[names[id(m)] for m in g] for g in groups],
                                 grads={n: p.grad for n, p in model.named_parameters()},
                                 line=float8.shared_input_line(model))
        plain, grouped = runs[False], runs[True]
        worst = max(((grouped["grads"][n] - g).norm() / g.norm()).item() for n, g in plain["grads"].items())
        out[arch] = dict(loss=[plain["loss"], grouped["loss"]], calls=[plain["calls"], grouped["calls"]],
                         groups=grouped["groups"], worst_grad=worst, lines=[plain["line"], grouped["line"]])
    print(json.dumps(out))
""")


def test_a_hugging_face_llamas_q_k_v_and_gate_up_run_as_one_gemm_each():
    """The HF family names the Linears of each decoder layer that read one input (its tensor-
    parallel plan's colwise layers of one gathered module); under fused_rowwise they run as one
    GEMM each: eagerly 8 casts a layer's forward instead of 14, the same loss, gradients within
    FP8's reach of each layer's own casts, and the start line says so."""
    out = interpreted(_HF_SHARED)
    for arch in ("llama", "qwen2"):
        got = out[arch]
        assert got["groups"] == [[f"model.layers.{i}.{p}" for p in names] for i in (0, 1)
                                 for names in (("mlp.gate_proj", "mlp.up_proj"),
                                               ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"))], got["groups"]
        assert got["calls"] == [[2 * 14, 2 * 14 + 2 * 7], [2 * 8, 2 * 8 + 2 * 4]], got["calls"]
        assert got["loss"][1] == pytest.approx(got["loss"][0], rel=1e-6)
        assert 0 < got["worst_grad"] < 0.05, got["worst_grad"]
        assert got["lines"] == ["", "fp8.recipe=fused_rowwise: 4 groups of Linears that read one input "
                                    "(gate_proj/up_proj, q_proj/k_proj/v_proj) run as one FP8 GEMM each"], got["lines"]
