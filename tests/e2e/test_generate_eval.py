"""mfsdp-generate and mfsdp-eval on a checkpoint that the CLI trained (+recipe=cpu_smoke on a small
BPE-tokenized corpus): greedy KV-cache generation gives the tokens of the model's own uncached
greedy forward (and transformers' on the exported HF directory), the chat template applies, a run
whose tokenizer is gone is refused in one line, and eval's loss on the validation token set equals
the validation loss the training logged for the same samples and weights."""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import pytest

from helpers import read_metrics, train_ranks, write_corpus
from mfsdp_launch.tools.evaluate import main as eval_main
from mfsdp_launch.tools.generate import main as generate_main

pytestmark = pytest.mark.slow

VOCAB = 320
STEPS, INTERVAL, VAL_STEPS, MBS, DP = 6, 3, 2, 4, 2
EOT = "<|endoftext|>"
CHAT_TEMPLATE = ("{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPT = "def main("


def _stdlib(*names: str):
    lib = Path(sysconfig.get_paths()["stdlib"])
    return [(lib / n).read_text(encoding="utf-8") for n in names]


def _corpus(path: Path, texts, tok, tok_file: Path) -> str:
    import numpy as np

    from mfsdp_launch.corpus.tokenizer import file_sha256

    eos = tok.token_to_id(EOT)
    docs = [np.array(tok.encode(t).ids + [eos]) for t in texts]
    return write_corpus(path, docs, vocab=VOCAB, sha=file_sha256(str(tok_file)), tokenizer_file=str(tok_file))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    from tokenizers import Tokenizer

    from mfsdp_launch.corpus.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("gen_eval")
    train_texts = _stdlib("textwrap.py", "string.py", "shlex.py", "glob.py", "fnmatch.py", "bisect.py")
    tok_file = root / "tokenizer" / "tokenizer.json"
    tok_file.parent.mkdir()
    train_bpe(train_texts, VOCAB, str(tok_file), eos=EOT)
    tok = Tokenizer.from_file(str(tok_file))
    train = _corpus(root / "train", train_texts, tok, tok_file)
    val = _corpus(root / "val", _stdlib("heapq.py", "colorsys.py"), tok, tok_file)
    run = root / "run"
    train_ranks("+recipe=cpu_smoke", f"run.dir={run}", "data=tokens", f"data.sources=[{{path: '{train}'}}]",
                f"data.val_sources=[{{path: '{val}'}}]", f"model.vocab_size={VOCAB}", f"train.steps={STEPS}",
                "train.seq_len=64", f"train.micro_batch_size={MBS}", "train.grad_accum_steps=1",
                f"train.val_interval={INTERVAL}", f"train.val_steps={VAL_STEPS}", f"checkpoint.interval={INTERVAL}",
                f"launcher.nproc_per_node={DP}", "train.progress=false")  # mfsdp-train's ranks (helpers.train_ranks)
    return {"run": run, "val": val, "tok": tok, "tok_file": tok_file, "root": root}


def _generate(capsys, *args) -> list:
    assert generate_main(list(map(str, args))) == 0, capsys.readouterr().err
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def _uncached_greedy(run: Path, prompt_ids, n: int):
    """The model's own forward on the whole sequence, argmax, n times: no cache involved."""
    import torch

    from mfsdp_launch.checkpoint.weights import read_model_state
    from mfsdp_launch.models import section_from
    from mfsdp_launch.models.llama.dims import resolve_gpt_dims
    from mfsdp_launch.models.llama.gpt_modules import GPT

    state, found = read_model_state(run)
    model = GPT(resolve_gpt_dims(section_from(found.manifest["config"]["model"])))
    model.load_state_dict(state)
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt_ids):]


def test_greedy_generation_with_the_kv_cache_matches_the_uncached_forward(trained, capsys):
    out, = _generate(capsys, trained["run"], "--prompt", PROMPT, "--max-new-tokens", 24, "--ignore-eos", "--json")
    tok = trained["tok"]
    assert out["prompt_ids"] == tok.encode(PROMPT).ids and out["step"] == STEPS and out["new_tokens"] == 24
    assert out["ids"] == _uncached_greedy(trained["run"], out["prompt_ids"], 24)
    assert out["completion"] == tok.decode(out["ids"]) and out["tokens_per_s"] > 0
    # Sampling: the same seed draws the same tokens; the text mode prints the rate.
    sampled = [_generate(capsys, trained["run"], "--prompt", PROMPT, "--max-new-tokens", 8, "--temperature", 0.9,
                         "--top-k", 20, "--top-p", 0.95, "--seed", 3, "--ignore-eos", "--json")[0]["ids"]
               for _ in range(2)]
    assert sampled[0] == sampled[1] and len(sampled[0]) == 8
    assert generate_main([str(trained["run"]), "--prompt", PROMPT, "--max-new-tokens", "4", "--step", str(INTERVAL)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(PROMPT) and f"4 new tokens" in text and "tokens/s" in text and f"step {INTERVAL}" in text


def test_an_exported_hf_directory_generates_the_same_and_applies_its_chat_template(trained, capsys, tmp_path):
    pytest.importorskip("transformers")
    from mfsdp_launch.tools.export import main as export_main

    hf = tmp_path / "hf"
    assert export_main([str(trained["run"]), str(hf), "--format", "hf"]) == 0
    (hf / "tokenizer.json").write_bytes(trained["tok_file"].read_bytes())
    (hf / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                          "eos_token": EOT, "chat_template": CHAT_TEMPLATE}))
    capsys.readouterr()
    ours, = _generate(capsys, trained["run"], "--prompt", PROMPT, "--max-new-tokens", 12, "--ignore-eos", "--json")
    theirs, = _generate(capsys, hf, "--prompt", PROMPT, "--max-new-tokens", 12, "--ignore-eos", "--json")
    assert theirs["prompt_ids"] == ours["prompt_ids"] and theirs["ids"] == ours["ids"]
    chat, = _generate(capsys, hf, "--prompt", "hi", "--chat", "--max-new-tokens", 4, "--json")
    assert chat["prompt_ids"] == trained["tok"].encode("<|user|>hi<|assistant|>").ids


def _one_error(capsys, prog: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    return err[0]


def test_a_run_whose_tokenizer_is_gone_is_refused_in_one_line(trained, capsys):
    tok_file = trained["tok_file"]
    moved = tok_file.with_name("moved.json")
    tok_file.rename(moved)
    try:
        assert generate_main([str(trained["run"]), "--prompt", "x"]) == 2
        line = _one_error(capsys, "mfsdp-generate")
        assert f"the run's tokenizer '{tok_file}'" in line and "give --tokenizer" in line
        assert generate_main([str(trained["run"]), "--prompt", "x", "--chat", "--tokenizer", str(moved)]) == 2
        assert "--chat: needs a chat template" in _one_error(capsys, "mfsdp-generate")
    finally:
        moved.rename(tok_file)


def test_eval_loss_equals_the_training_validation_of_the_same_samples(trained, capsys, tmp_path):
    run, plot = trained["run"], tmp_path / "eval.png"
    samples = VAL_STEPS * MBS * DP  # what each validation read: val samples 0..samples-1
    assert eval_main([str(run), "--data", trained["val"], "--all", "--samples", str(samples), "--plot", str(plot)]) == 0
    printed = capsys.readouterr().out
    assert plot.stat().st_size > 0 and "appended 2 eval row(s)" in printed
    rows = read_metrics(run)
    val = {r["step"]: r for r in rows if "val_loss" in r}
    evals = {r["step"]: r for r in rows if "eval/loss" in r}
    assert sorted(evals) == [INTERVAL, STEPS] and sorted(val) == [INTERVAL, STEPS]
    for step, e in evals.items():
        assert e["eval/loss"] == pytest.approx(val[step]["val_loss"], rel=1e-5), step
        assert e["eval/ppl"] == pytest.approx(math.exp(e["eval/loss"])) == pytest.approx(val[step]["val_ppl"], rel=1e-4)
        assert e["eval/tokens"] == samples * 64
    from mfsdp_launch.tools.report import summary_text

    summary = summary_text([run], [rows], ["run"])
    assert f"final loss" in summary and f"eval loss {evals[STEPS]['eval/loss']:.4f}" in summary
    assert eval_main([str(run), "--data", str(trained["root"] / "nowhere")]) == 2
    assert _one_error(capsys, "mfsdp-eval").startswith("mfsdp-eval: error: --data")
