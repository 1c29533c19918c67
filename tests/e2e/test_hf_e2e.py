"""Hugging Face interop through the CLI: a trained `gpt` exports with `--format hf` and loads in
transformers with the launcher model's logits; `model.init_from` restarts from that directory at
the exporting run's loss; `model=hf` trains a tiny Llama (from a local directory, pretrained
weights loaded into the FSDP2 shards) and a tiny Qwen2 (from a config dict) and exports with its
own keys; bad input is one line, exit 2, before anything is spawned."""

from __future__ import annotations

import json

import pytest

from helpers import cli, cli_env, cli_error, losses, refused, train_ranks, unknown_key

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

SEQ = 32
BASE = ["+recipe=cpu_smoke", "train.log_interval=1", "train.progress=false", f"train.seq_len={SEQ}"]
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)


@pytest.fixture(scope="module")
def window(tmp_path_factory):
    """A corpus of exactly one training window: every sample, at every step, is this text, so a
    loss logged at any step is the loss of that step's weights on a batch the test knows."""
    path = tmp_path_factory.mktemp("corpus") / "window.txt"
    path.write_bytes((b"The quick brown fox jumps over the lazy dog. " * 2)[:SEQ + 1])
    return path


def window_batch(path) -> dict:
    ids = torch.tensor(list(path.read_bytes()), dtype=torch.long)[None]
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def train(run_dir, *overrides) -> str:
    """mfsdp-train's ranks (helpers.train_ranks; the CLI around them is proven in tests/e2e's
    other files); returns rank 0's output."""
    return train_ranks(*BASE, f"run.dir={run_dir}", *overrides)


def export_hf(ckpt, out_dir, capsys):
    """mfsdp-export's main() with the command line's arguments, in this process (a process of its
    own would import torch again for a few KB of tensors)."""
    from mfsdp_launch.tools.export import main as export_main

    capsys.readouterr()
    assert export_main([str(ckpt), str(out_dir), "--format", "hf"]) == 0, capsys.readouterr().err
    assert "(hf," in capsys.readouterr().out
    return out_dir


def cli_refused(tmp_path, *overrides, env=None) -> str:
    """The CLI's one-line refusal, without its prefix; nothing was written."""
    line = cli_error(cli(*overrides, f"run.dir={tmp_path / 'refused'}", env=env, timeout=300))
    assert not (tmp_path / "refused").exists()
    return line[len("mfsdp-train: error: "):]


@pytest.mark.slow
def test_gpt_exports_to_transformers_and_init_from_restarts_at_its_loss(tmp_path, window, capsys):
    from mfsdp_launch.checkpoint.weights import read_model_state
    from mfsdp_launch.models.llama.gpt_modules import GPT
    from mfsdp_launch.models.llama.dims import GPTDims

    a, b = tmp_path / "A", tmp_path / "B"
    dims = ["model.n_kv_heads=2", "model.rope_theta=500000", "model.norm_eps=1e-6"]
    train(a, "train.steps=3", "checkpoint.interval=2", f"data.path={window}", *dims)
    hf_dir = export_hf(a / "checkpoints" / "step_2", tmp_path / "hf", capsys)
    config = json.loads((hf_dir / "config.json").read_text())
    assert (config["num_key_value_heads"], config["rope_theta"], config["rms_norm_eps"]) == (2, 500000.0, 1e-6)

    ours = GPT(GPTDims(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=256,
                       tie_embeddings=False, norm_eps=1e-6, rope_theta=500000.0)).eval()
    ours.load_state_dict(read_model_state(a / "checkpoints" / "step_2")[0])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() <= 1e-4

    # The dims come from config.json (none given here); the first step's loss is A's at step 3,
    # both of step 2's weights on the same batch. A trained (and saved) sharded over 2 ranks; B
    # loads on 1: every sample is the one window, so its loss is the same number at any batch.
    out = train(b, "train.steps=1", f"data.path={window}", f"model.init_from={hf_dir}",
                "launcher.nproc_per_node=1")
    assert "model.init_from: loaded 15 tensors" in out, out
    assert losses(b)[1] == pytest.approx(losses(a)[3], rel=1e-6, abs=0)

    msg = cli_refused(tmp_path, f"model.init_from={hf_dir}", "model.n_kv_heads=4")
    assert msg == f"model.n_kv_heads: 4 but {hf_dir}/config.json has num_key_value_heads=2"


@pytest.mark.slow
def test_hf_llama_directory_trains_from_its_pretrained_weights_and_exports(tmp_path, window, capsys):
    from mfsdp_launch.checkpoint.weights import read_model_state

    torch.manual_seed(0)
    pretrained = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
    pretrained.save_pretrained(tmp_path / "llama")
    run = tmp_path / "run"
    out = train_ranks(*BASE, f"run.dir={run}", "model=hf", f"model.path={tmp_path / 'llama'}", "model.pretrained=true",
                      "train.steps=2", f"data.path={window}")  # mfsdp-train's ranks, on 2 (the CLI: test above)
    assert "model.pretrained: loaded" in out and "model hf:" in out, out
    assert "host RSS peak per rank during the load" in out, out
    batch = window_batch(window)
    with torch.no_grad():
        logits = pretrained(batch["input_ids"]).logits
        expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item()
    assert losses(run)[1] == pytest.approx(expected, rel=1e-5)

    hf_dir = export_hf(run, tmp_path / "export", capsys)
    assert (hf_dir / "generation_config.json").is_file()  # the source directory's side files come along
    saved = read_model_state(run)[0]
    back = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    assert type(back).__name__ == "LlamaForCausalLM"
    state = back.state_dict()
    assert state.keys() == saved.keys() and all(torch.equal(state[k], saved[k]) for k in saved)


@pytest.mark.slow
def test_hf_qwen2_from_a_config_dict_trains_with_meta_init(tmp_path):
    fields = ", ".join(f"{k}: {v}" for k, v in TINY.items())
    run = tmp_path / "run"
    # 1 rank: each rank imports transformers (the costliest part of a run); the Llama test above
    # is the one that loads into shards over 2 ranks.
    out = train_ranks(*BASE, f"run.dir={run}", "model=hf", "model.hf_class=Qwen2ForCausalLM",
                      f"model.hf_config={{{fields}, tie_word_embeddings: true}}", "model.init_on_meta=true",
                      "data=synthetic", "train.steps=2", "launcher.nproc_per_node=1")
    assert "model hf:" in out
    got = losses(run)
    assert sorted(got) == [1, 2] and abs(got[1] - torch.log(torch.tensor(256.0)).item()) < 0.1, got


def test_hf_bad_input_is_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    assert cli_refused(tmp_path, "model=hf", f"model.path={tmp_path / 'empty'}") == \
        f"model.path: {tmp_path / 'empty'} has no config.json"
    assert "nothing is downloaded" in cli_refused(tmp_path, "model=hf", "model.path=meta-llama/Llama-3.1-8B")
    # In process (ConfigError, the same line the CLI prints): a CLI checking a config dict imports
    # transformers, which costs more than everything else in this test.
    bert = "{model_type: bert, hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4, vocab_size: 256}"
    assert "is not a causal language model" in str(refused("model=hf", f"model.hf_config={bert}"))
    assert cli_refused(tmp_path, "model=gpt", "model.target=x:y") == unknown_key("model.target", "gpt")
    assert unknown_key("model.target", "gpt").startswith(
        "model.target: model=gpt|te_gpt does not read it (a key of model=custom) (allowed: name|params_dtype|")


@pytest.mark.parametrize("overrides,expected", [
    (["model.hf_class=LlamaForCausalLM", "model.hf_config={vocab_size: 100, num_hidden_layers: 1}", "data=text"],
     "model.vocab_size: 100 is smaller than the vocab 256 of the byte tokenizer (data.tokenizer=null)"),
    (["model.hf_class=LlamaForCausalLM", "model.hf_config={num_hidden_layers: 1}", "model.loss=model"],
     unknown_key("model.loss", "hf")),
    (["model.hf_class=LlamaForCausalLM", "model.hf_config={num_hidden_layers: 1}", "model.pretrained=true"],
     "model.pretrained: true needs model.path, the directory holding the weights"),
    (["model.hf_class=LlamaForCausalLM", "model.hf_config={num_hidden_layers: 1}", "model.n_layers=2"],
     unknown_key("model.n_layers", "hf")),
], ids=["vocab", "loss", "pretrained-without-path", "gpt-key"])
def test_more_hf_bad_input_in_process(overrides, expected):
    assert str(refused("model=hf", *overrides)) == expected


def test_pretrained_weights_are_checked_against_the_model_before_spawning(tmp_path):
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, intermediate_size=96)))
    err = refused("model=hf", f"model.path={tmp_path}", "model.pretrained=true")
    assert str(err) == (f"model.pretrained: model.layers.0.mlp.gate_proj.weight has shape [128, 64] in "
                              f"{tmp_path}, the model needs [96, 64]")


def test_without_transformers_model_hf_names_the_extra(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['transformers'] = None\n")
    env = {"PYTHONPATH": f"{tmp_path}:{cli_env()['PYTHONPATH']}"}
    assert cli_refused(tmp_path, "model=hf", "model.hf_class=LlamaForCausalLM", env=env) == \
        "model: model=hf needs transformers, which is not installed (pip install 'mfsdp-launch[hf]')"
