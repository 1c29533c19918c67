"""The memory estimate under `optim.name=muon`: the matrices Muon updates keep one momentum buffer,
the rest Adam's two moments. The family's count is the optimizer's own choice of parameters
(components/muon.muon_parameters) on the built model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from mfsdp_launch.components.muon import muon_parameters  # noqa: E402
from mfsdp_launch.mesh import ParallelDims  # noqa: E402
from mfsdp_launch.models import family  # noqa: E402
from mfsdp_launch.models.llama.dims import muon_matrix_params, resolve_gpt_dims  # noqa: E402
from mfsdp_launch.models.llama.gpt_modules import GPT  # noqa: E402
from mfsdp_launch.models.probe import measure  # noqa: E402
from mfsdp_launch.planner import prepare  # noqa: E402
from mfsdp_launch.planner.memory import estimate  # noqa: E402


def _muon_numel(model) -> int:
    ids = muon_parameters(model)
    return sum(p.numel() for p in model.parameters() if id(p) in ids)


@pytest.mark.parametrize("preset,extra", [("tiny", {}), ("tiny", {"tie_embeddings": True}), ("tiny_moe", {}),
                                          ("deepseek-v2-lite", {"n_layers": 2, "dim": 64, "n_heads": 4})])
def test_gpt_count_is_what_muon_updates(preset, extra):
    m = SimpleNamespace(preset=preset, **extra)
    dims = resolve_gpt_dims(m)
    with torch.device("meta"):
        model = GPT(dims)
    assert muon_matrix_params(dims) == _muon_numel(model) > 0


def test_the_probe_counts_what_muon_updates():
    class LM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(100, 16)
            self.block = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 16))
            self.head = torch.nn.Linear(16, 100, bias=False)

    with torch.device("meta"):
        got = measure(LM(), [])
    assert got["muon_params"] == 16 * 32 + 32 * 16  # the two block matrices: not biases, norm, embedding, head


def _optimizer_line(*overrides):
    cfg, _ = prepare(["+recipe=cpu_smoke", "launcher.dry_run=true", *overrides], check_hardware=False)
    est = estimate(cfg, ParallelDims.from_config(cfg.mesh, cfg.launcher.nproc_per_node))
    return est.optimizer, cfg


def test_muon_keeps_one_buffer_for_its_matrices():
    adam, cfg = _optimizer_line()
    muon, _ = _optimizer_line("optim.name=muon")
    fam, m = family(cfg.model.name), cfg.model
    n, k = fam.param_count(m), fam.muon_matrix_params(m)
    assert 0 < k < n
    assert muon / adam == pytest.approx((n - k / 2) / n)
