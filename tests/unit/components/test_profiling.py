"""train.profile: a torch.profiler trace per rank and rank 0's top-ops table, from a real
2-process gloo run as mfsdp-train's ranks run it (helpers.train_ranks); its one-line refusals."""

import gzip
import json

import pytest

from helpers import refused, train_ranks
from mfsdp_launch.planner import prepare
from mfsdp_launch.components.profiling import PROFILE_DIR, TOP_OPS, TOP_N, trace_name

BASE = ["engine=fsdp2", "model=gpt", "model.preset=tiny", "data=synthetic", "train.seq_len=32",
        "train.micro_batch_size=2", "train.log_interval=1", "train.progress=false", "checkpoint.save_final=false",
        "launcher.nproc_per_node=2"]


@pytest.mark.slow
def test_profile_writes_a_trace_per_rank_and_the_top_ops(tmp_path):
    run = tmp_path / "r"
    out = train_ranks(*BASE, f"run.dir={run}", "train.steps=4", "train.profile={start: 2, steps: 2}")
    for rank in (0, 1):
        with gzip.open(run / PROFILE_DIR / trace_name(rank), "rt") as f:
            events = json.load(f)["traceEvents"]
        names = {e.get("name", "") for e in events}
        assert any(n.startswith("aten::") for n in names), sorted(names)[:20]  # real ops were recorded
    table = (run / PROFILE_DIR / TOP_OPS).read_text()
    assert "top 15 ops by self CPU time, steps 2-3, rank 0" in table and "Self CPU" in table
    body = [line for line in table.splitlines() if line.strip().startswith("aten::")]
    assert 0 < len(body) <= TOP_N
    assert table.splitlines()[0] in out  # rank 0 printed it to its stdout (the console's)


@pytest.mark.parametrize("profile, key", [("{start: 0, steps: 2}", "train.profile.start"),
                                          ("{start: 2, steps: -1}", "train.profile.steps"),
                                          ("{start: 9, steps: 3}", "train.profile")])
def test_profile_window_must_fit_the_run(profile, key):
    e = refused(*BASE, "train.steps=10", f"train.profile={profile}")
    assert e.key == key and "\n" not in str(e)


def test_profile_window_ending_on_the_last_step_is_fine():
    cfg, _ = prepare([*BASE, "train.steps=10", "train.profile={start: 8, steps: 3}"], check_hardware=False)
    assert (cfg.train.profile.start, cfg.train.profile.steps) == (8, 3)
    cfg, _ = prepare(BASE, check_hardware=False)
    assert cfg.train.profile.steps == 0  # off by default
    cfg, _ = prepare([*BASE, "train.profile=null"], check_hardware=False)
    assert cfg.train.profile is None
    cfg, _ = prepare([*BASE, "train.steps=5", "train.profile.steps=2", "train.profile.start=4"], check_hardware=False)
    assert (cfg.train.profile.start, cfg.train.profile.steps) == (4, 2)
