"""`model=custom` (models/custom/user_model.py): target resolution, unit proposals, the batch/loss
contract and meta-device sizes, with the user's modules (helpers' sample model and variants of it)
written to a temporary package."""

from __future__ import annotations

import textwrap
from types import SimpleNamespace

import pytest

from helpers import USER_MODULE

torch = pytest.importorskip("torch")

from mfsdp_launch.core.errors import ConfigError  # noqa: E402
from mfsdp_launch.models import losses  # noqa: E402
from mfsdp_launch.models.custom import user_model as um  # noqa: E402
from mfsdp_launch.models import family  # noqa: E402
from mfsdp_launch.models.llama import dims as sizes  # noqa: E402
from mfsdp_launch.models.llama.gpt_modules import GPT, Block  # noqa: E402

# Appended to helpers' sample module (Block, LM, build(vocab=256, dim=32, n_layers=2), NOT_CALLABLE).
MORE_MODELS = '''
import torch.nn.functional as F


class LossLM(LM):
    def forward(self, input_ids, labels):
        logits = super().forward(input_ids)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


class LogitsNotLoss(LM):
    def forward(self, input_ids, labels):  # breaks the contract: logits, not the loss
        return super().forward(input_ids)


def build_loss_lm(vocab=256, dim=32, n_layers=2):
    return LossLM(vocab, dim, n_layers)


def build_mlp():
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))


def not_a_module():
    return 3
'''


@pytest.fixture
def user_pkg(tmp_path, monkeypatch):
    pkg = tmp_path / "userpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text(textwrap.dedent(USER_MODULE) + textwrap.dedent(MORE_MODELS))
    (pkg / "broken.py").write_text("raise RuntimeError('boom at import')\n")
    (pkg / "needs_dep.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "userpkg"


def test_both_target_forms_resolve(user_pkg):
    a = um.resolve_target(f"{user_pkg}.models:build")
    b = um.resolve_target(f"{user_pkg}.models.build")
    assert a is b and a.__name__ == "build"
    assert um.resolve_target(f"{user_pkg}.models:LM").__name__ == "LM"  # a class is callable


@pytest.mark.parametrize("spec,needle", [
    ("no_such_pkg_xyz.models:build", "no module named 'no_such_pkg_xyz'"),
    ("{pkg}.nope:build", "no module named '{pkg}.nope'"),
    ("{pkg}.models:nope", "'{pkg}.models' has no attribute 'nope'"),
    ("{pkg}.models.nope", "'{pkg}.models' has no attribute 'nope'"),
    ("{pkg}.models:NOT_CALLABLE", "is a int, not callable"),
    ("{pkg}.broken:build", "importing '{pkg}.broken' failed (RuntimeError: boom at import)"),
    ("{pkg}.needs_dep.build", "importing '{pkg}.needs_dep' failed (ModuleNotFoundError"),
    ("build", "is not of the form"),
    ("a:b:c", "is not of the form"),
])
def test_target_errors_are_one_line(user_pkg, spec, needle):
    with pytest.raises(ConfigError) as err:
        um.resolve_target(spec.format(pkg=user_pkg))
    msg = str(err.value)
    assert msg.startswith("model.target: ") and "\n" not in msg, msg
    assert needle.format(pkg=user_pkg) in msg, msg


def test_build_user_model_checks_kwargs_and_the_result(user_pkg):
    model = um.build_user_model(f"{user_pkg}.models:build", {"n_layers": 3})
    assert len(model.blocks) == 3
    with pytest.raises(ConfigError, match=r"^model.kwargs: .*build: got an unexpected keyword argument 'depth'"):
        um.build_user_model(f"{user_pkg}.models:build", {"depth": 2})
    with pytest.raises(ConfigError, match=r"^model.target: .*returned a int, not a torch.nn.Module"):
        um.build_user_model(f"{user_pkg}.models:not_a_module")


def test_propose_unit_modules():
    dims = sizes.GPTDims(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=256,
                         tie_embeddings=False, norm_eps=1e-5, rope_theta=1e4)
    gpt = um.build_on_meta(lambda: GPT(dims))
    assert um.propose_unit_modules(gpt) == ["mfsdp_launch.models.llama.gpt_modules.Block"]
    assert um.resolve_unit_classes(um.propose_unit_modules(gpt), gpt) == (Block,)


def test_propose_unit_modules_on_user_models(user_pkg):
    tiny = um.build_user_model(f"{user_pkg}.models:build")
    assert um.propose_unit_modules(tiny) == [f"{user_pkg}.models.Block"]
    mlp = um.build_user_model(f"{user_pkg}.models:build_mlp")  # repeats only leaves
    assert um.propose_unit_modules(mlp) == ["torch.nn.modules.linear.Linear"]


def test_unit_module_refusals_list_the_proposal(user_pkg):
    tiny = um.build_user_model(f"{user_pkg}.models:build")
    with pytest.raises(ConfigError) as err:
        um.resolve_unit_classes([], tiny)
    assert str(err.value) == (f"model.fsdp_unit_modules: is empty; name the classes to shard one by one "
                              f"(the model repeats: {user_pkg}.models.Block)")
    with pytest.raises(ConfigError) as err:
        um.resolve_unit_classes(["mfsdp_launch.models.llama.gpt_modules.Block"], tiny)
    assert str(err.value) == (f"model.fsdp_unit_modules: the model contains no mfsdp_launch.models.llama.gpt_modules.Block "
                              f"(it repeats: {user_pkg}.models.Block)")
    with pytest.raises(ConfigError, match="is not an nn.Module class"):
        um.resolve_unit_classes([f"{user_pkg}.models.build"], tiny)


def test_loss_modes_follow_the_batch_contract(user_pkg):
    torch.manual_seed(0)
    logits_model = um.build_user_model(f"{user_pkg}.models:build")
    loss_model = um.build_user_model(f"{user_pkg}.models:build_loss_lm")
    loss_model.load_state_dict(logits_model.state_dict())
    assert um.resolve_loss_mode(logits_model) == "cross_entropy"
    assert um.resolve_loss_mode(loss_model) == "model"
    assert um.resolve_loss_mode(loss_model, "cross_entropy") == "cross_entropy"
    with pytest.raises(ConfigError, match=r"^model.loss: unknown loss 'mse' \(allowed: auto\|cross_entropy\|model\)"):
        um.resolve_loss_mode(loss_model, "mse")
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    a = um.loss_fn("cross_entropy")(logits_model, batch)
    b = um.loss_fn("model")(loss_model, batch)
    assert a.ndim == 0 and torch.allclose(a, b)
    bad = um.build_on_meta(lambda: um.import_object(f"{user_pkg}.models:LogitsNotLoss", key="k")(256, 32, 2))
    with pytest.raises(RuntimeError, match=r"returned \(2, 8, 256\), not a scalar loss"):
        losses.model_loss(bad, {"input_ids": batch["input_ids"].to("meta"), "labels": batch["labels"].to("meta")})


def test_custom_model_trains(user_pkg):
    torch.manual_seed(0)
    model = um.build_user_model(f"{user_pkg}.models:build")
    loss = um.loss_fn(um.resolve_loss_mode(model))
    ids = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(3):
        value = loss(model, batch)
        opt.zero_grad()
        value.backward()
        opt.step()
        losses.append(value.item())
    assert losses[0] > losses[1] > losses[2], losses


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_meta_stats_of_gpt_equal_the_analytic_counts(tie):
    cfg = SimpleNamespace(name="gpt", preset="tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192,
                          vocab_size=256, tie_embeddings=tie, norm_eps=1e-5, rope_theta=1e4, fsdp_unit_modules=[])
    model = um.build_on_meta(lambda: GPT(sizes.resolve_gpt_dims(cfg)))
    assert all(p.is_meta for p in model.parameters())
    stats = um.model_stats(model, seq_len=128, unit_classes=(Block,))
    dims = sizes.resolve_gpt_dims(cfg)
    assert stats.num_params == family("gpt").param_count(cfg)
    assert stats.matmul_params == sizes.matmul_params(dims)
    assert stats.flops_per_token == family("gpt").flops_per_token(cfg, 128)
    assert stats.largest_unit_params == family("gpt").largest_unit_params(cfg)
    assert stats.param_bytes == 4 * stats.num_params


def test_meta_stats_of_a_model_without_dims(user_pkg):
    model = um.build_on_meta(lambda: um.build_user_model(f"{user_pkg}.models:build"))
    stats = um.model_stats(model, seq_len=128)
    n_matmul = 2 * (2 * 32 * 128) + 256 * 32  # two blocks of two Linears, and the head; not the embedding
    assert stats.dims is None and stats.matmul_params == n_matmul and stats.flops_per_token == 6 * n_matmul
    assert stats.largest_unit_params == stats.num_params  # no units: the root holds everything
