"""One GPU, through the CLI: `train.cuda_graph=full_iteration` without Transformer Engine, eager and
with `train.compile=true`, under Megatron-FSDP.

The graph holds forward, loss and backward (and the engine's gradient reduction); torch's fused
AdamW steps eagerly between replays on the gradient views the graph writes. Under train.compile
the warm-up iterations compile every block, and the capture records Inductor's kernels. Each
graph run must give its un-graphed twin's losses, and a compiled graph run resumed from its own
checkpoint (captured anew after the load) must give the uninterrupted run's losses.
"""

from __future__ import annotations

import pytest

import _one_gpu as G
from _one_gpu import assert_close, assert_learns, uses

pytestmark = pytest.mark.gpu

SEQ = 64
STEPS = 8
# bf16 compute over fp32 main weights and gradients (the graph needs main grads = main params)
BASE = [*G.tiny_gpt_bf16(SEQ, STEPS), "optim.impl=torch", "precision.main_grads_dtype=fp32"]
GRAPH = "train.cuda_graph=full_iteration"
COMPILE = "train.compile=true"
ONCE = ["checkpoint.save_final=false"]

G.train("cg_eager", *BASE, *ONCE)
G.train("cg_graph", *BASE, *ONCE, GRAPH)
G.train("cg_compile", *BASE, *ONCE, COMPILE)
G.train("cg_compile_graph", *BASE, COMPILE, GRAPH, "checkpoint.interval=4", priority=0)
G.train("cg_compile_graph_c", *BASE, COMPILE, GRAPH, "checkpoint.interval=4", after=["cg_compile_graph"],
        prepare=G.copy_checkpoint("cg_compile_graph", 4))


@pytest.mark.parametrize("graph,ref", [("cg_graph", "cg_eager"), ("cg_compile_graph", "cg_compile")])
@uses(lambda p: [p["graph"], p["ref"]])
def test_full_iteration_graph_gives_the_ungraphed_losses(request, graph, ref):
    want = G.get(request, ref).ok().losses()
    assert_learns(want, STEPS, min_drop=0.5, what=ref)
    r = G.get(request, graph).ok()
    cfg = r.config()
    assert str(cfg.train.cuda_graph) == "full_iteration" and str(cfg.optim.impl) == "torch"
    assert cfg.train.compile is (graph == "cg_compile_graph")
    assert "train.cuda_graph: full_iteration: step 1 captured" in r.stdout, r.tail()
    # The replays run the un-graphed step's kernels in its order: the same losses to the bit
    # (seen on one H100, 2026-12-06).
    assert_close(r.losses(), want, range(1, STEPS + 1), rel=1e-6, what=f"{graph} vs {ref}")


@uses("cg_compile_graph", "cg_compile_graph_c")
def test_compiled_graph_run_resumes_with_the_uninterrupted_losses(request):
    a = G.get(request, "cg_compile_graph").ok()
    assert (a.run_dir / "checkpoints" / f"step_{STEPS}" / "manifest.json").is_file()
    r = G.get(request, "cg_compile_graph_c").ok()
    assert "resuming from step 4" in r.stdout and "full_iteration: step 5 captured" in r.stdout, r.tail()
    got = r.losses()
    assert sorted(got) == list(range(5, STEPS + 1)), sorted(got)
    assert_close(got, a.losses(), range(5, STEPS + 1), rel=1e-6, what="compiled graph resumed vs uninterrupted")
