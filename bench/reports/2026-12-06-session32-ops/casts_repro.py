"""Session 32's device experiment (not in the package): a gpt-shaped block of fp8.recipe=fused_rowwise
linears at the 8B slice's shapes, compiled against eager. Run with triton_op_casts.patch applied."""
import time, torch, torch.nn as nn, torch.nn.functional as F
from mfsdp_launch.components import fp8_linear
print("torch", torch.__version__, "triton", __import__("triton").__version__, flush=True)

class Blk(nn.Module):
    def __init__(s):
        super().__init__()
        s.wqkv, s.wo = nn.Linear(4096, 6144, bias=False), nn.Linear(4096, 4096, bias=False)
        s.gate_up, s.down = nn.Linear(4096, 28672, bias=False), nn.Linear(14336, 4096, bias=False)
    def forward(s, x):
        h = x + s.wo(s.wqkv(x)[..., :4096])
        g, u = s.gate_up(F.rms_norm(h, (4096,))).chunk(2, -1)
        return h + s.down(F.silu(g) * u)

torch.manual_seed(0)
m = Blk().cuda().bfloat16()
fp8_linear.convert([m.wqkv, m.wo, m.gate_up, m.down])
x = torch.randn(1, 8192, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
def run(f):
    for p in m.parameters(): p.grad = None
    x.grad = None
    y = f(x); y.float().square().mean().backward()
    torch.cuda.synchronize()
    return y.detach(), x.grad.clone(), m.down.weight.grad.clone()
ref = run(m)
cf = torch.compile(m.forward)
for i in range(3):
    got = run(cf)
rel = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, ref)]
print("compiled vs eager (y, dx, dW_down):", ["%.2e" % r for r in rel], flush=True)
for f, name in ((m, "eager"), (cf, "compiled")):
    run(f); torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(10): run(f)
    print(name, "%.2f ms" % ((time.perf_counter() - t) / 10 * 1e3), flush=True)
