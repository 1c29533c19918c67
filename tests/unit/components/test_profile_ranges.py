"""The MoE layers' ranges in train.profile (components/profile_ranges.py): a forward and a backward
range per layer while the profiler records (none, and no hook, otherwise), the backward range
holding the layer's backward ops, and the line on the layers' time and their grouped GEMMs' share:
in process on a tiny MoE gpt, and through a profiled 2-rank run's top_ops.txt."""

import re

import pytest

from helpers import model_cfg, train_ranks

torch = pytest.importorskip("torch")

from mfsdp_launch.components import profile_ranges as pr  # noqa: E402
from mfsdp_launch.components.profiling import PROFILE_DIR, TOP_OPS  # noqa: E402
from mfsdp_launch.models import build_model_spec  # noqa: E402


def test_ranges_and_hooks_only_while_the_profiler_records():
    x = torch.randn(3, 4, requires_grad=True)
    assert pr.profiled("t", x, lambda t: 2 * t)._backward_hooks is None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y = pr.profiled("t", x, lambda t: (2 * t) @ torch.ones(4, 4))
        assert y._backward_hooks
        y.sum().backward()
    ranges = {e.name: e for e in prof.events() if e.name.startswith("t.")}
    assert set(ranges) == {"t.forward", "t.backward"}
    below = {c.name for c in ranges["t.backward"].cpu_children}
    assert any("Backward" in n or n.startswith("aten::") for n in below), below  # the part's backward ran inside
    assert torch.equal(x.grad, torch.full((3, 4), 8.0))  # the hooks pass the gradients through


def test_a_moe_gpt_reports_its_layers_time_and_the_gemms_share():
    spec = build_model_spec(model_cfg("gpt", preset="tiny_moe"), 32)
    model = spec.build()
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        spec.loss(model, {"input_ids": ids, "labels": ids}).backward()
    names = [e.name for e in prof.events() if e.name.startswith(pr.MOE)]
    assert sorted(names) == [f"{pr.MOE}.backward"] * 2 + [f"{pr.MOE}.forward"] * 2  # tiny_moe: 2 MoE layers
    # On the CPU the experts are a loop of aten::mm: their share stands in for the grouped GEMMs'.
    line = pr.share_line(prof.events(), pr.MOE, ("aten::mm",), False, "MoE layers")
    got = re.fullmatch(r"MoE layers: ([\d.]+) ms of CPU time in 4 ranges \(([\d.]+) % of the profiled steps\); "
                       r"aten::mm: ([\d.]+) ms, ([\d.]+) % of it", line)
    assert got and 0 < float(got[2]) < 100 and 0 < float(got[4]) < 100, line
    assert pr.share_line(prof.events(), "nothing", ("aten::mm",), False, "x") is None


def test_the_gpu_share_leaves_out_the_hosts_waits_on_a_full_launch_queue():
    # A GPU trace's event tree, in the attributes torch.profiler's FunctionEvent has: CUPTI's
    # "Command Buffer Full" records carry device time (the host waiting to launch), no kernels.
    import types

    def event(name, self_us, *children):
        return types.SimpleNamespace(name=name, self_device_time_total=self_us, cpu_children=list(children),
                                     device_time_total=self_us + sum(c.device_time_total for c in children))

    wait = event("Command Buffer Full", 900.0)
    gemm = event("aten::_grouped_mm", 600.0)
    scatter = event("aten::index_add_", 300.0, event("Command Buffer Full", 500.0))
    layer = event(f"{pr.MOE}.forward", 100.0, gemm, scatter)
    optimizer = event("aten::_fused_adamw_", 1000.0, wait)
    events = [layer, gemm, scatter, scatter.cpu_children[0], optimizer, wait]
    line = pr.share_line(events, pr.MOE, ("aten::_grouped_mm",), True, "MoE layers")
    # the layer: 100 + 600 + 300 us of kernels; the steps: those and the optimizer's 1000 us
    assert line == ("MoE layers: 1.0 ms of GPU time in 1 ranges (50.0 % of the profiled steps); "
                    "aten::_grouped_mm: 0.6 ms, 60.0 % of it"), line


def test_the_top_ops_table_drops_the_waits_and_keeps_every_op():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.randn(64, 64) @ torch.randn(64, 64)
    averages = prof.key_averages()
    assert pr.without_waits(averages) is averages  # nothing to drop
    averages[0].key = "Command Buffer Full"  # as CUPTI names the host's waits in a GPU trace
    kept = pr.without_waits(averages)
    assert [a.key for a in kept] == [a.key for a in averages[1:]]
    assert "Command Buffer Full" not in kept.table(sort_by="self_cpu_time_total", row_limit=20)


@pytest.mark.slow
def test_a_profiled_moe_run_writes_the_line(tmp_path):
    run = tmp_path / "r"
    train_ranks("engine=fsdp2", "model=gpt", "model.preset=tiny_moe", "data=synthetic", "train.seq_len=32",
                "train.micro_batch_size=2", "train.log_interval=1", "train.progress=false",
                "checkpoint.save_final=false", "launcher.nproc_per_node=2", f"run.dir={run}", "train.steps=3",
                "train.profile={start: 2, steps: 1}")
    table = (run / PROFILE_DIR / TOP_OPS).read_text()
    assert re.search(r"MoE layers \(forward \+ backward\): [\d.]+ ms of CPU time in 4 ranges", table), table[-600:]
