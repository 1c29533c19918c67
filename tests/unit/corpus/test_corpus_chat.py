"""mfsdp-data prepare --chat (corpus/chat.py): each input shape renders like transformers'
apply_chat_template with a tiny tokenizer made here, the loss mask covers the assistant turns
and nothing else (the loader's labels are -100 everywhere else), --train-on last|all, a template
with {% generation %} blocks gives transformers' assistant mask, bad rows are counted and
reported, and bad input is one line before any work."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from helpers import EOS
from mfsdp_launch.core.errors import ConfigError
from mfsdp_launch.corpus import shards
from mfsdp_launch.corpus.prepare import main as data_main
from mfsdp_launch.corpus.prepare import prepare
from mfsdp_launch.corpus.tokenizer import train_bpe
from mfsdp_launch.data import TokenBatches

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# The same with the assistant text marked for transformers' return_assistant_tokens_mask.
GENERATION = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
              "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
              "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\\n' }}"
              "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SYSTEM, Q1, A1, Q2, A2 = "Be brief.", "Hello, how are you?", "Fine, thank you.", "What is two plus two?", "Four."
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": Q1},
            {"role": "assistant", "content": A1}, {"role": "user", "content": Q2},
            {"role": "assistant", "content": A2}]
# Each input shape, and the turns it means.
SHAPES = [
    ({"messages": MESSAGES}, MESSAGES),
    ({"prompt": Q2, "completion": A2}, [{"role": "user", "content": Q2}, {"role": "assistant", "content": A2}]),
    ({"prompt": MESSAGES[:4], "completion": MESSAGES[4:]}, MESSAGES),
    ({"system": SYSTEM, "conversations": [{"from": "human", "value": Q1}, {"from": "gpt", "value": A1}]},
     MESSAGES[:3]),
]
BAD = ['{"messages": [{"role": "user", "content": "no answer"}]}', "{not json", '"a string"',
       '{"text": "no turns"}',
       '{"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}',
       '{"messages": [{"role": "user"}, {"role": "assistant", "content": "y"}]}']
BAD_COUNTS = {"no_assistant": 1, "bad_json": 2, "no_messages": 1, "bad_role": 1, "bad_message": 1}


def _tokenizer_dir(root, template):
    from tokenizers import Tokenizer

    root.mkdir()
    texts = [f"{SYSTEM} {Q1} {A1} {Q2} {A2} user assistant system"] * 20
    train_bpe(texts, 300, str(root / "tokenizer.json"))
    tok = Tokenizer.from_file(str(root / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(root / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if template:
        config["chat_template"] = template
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return str(root)


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    rows = root / "chats.jsonl"
    lines = [json.dumps(row) for row, _ in SHAPES]
    rows.write_text("\n".join(lines[:2] + BAD + lines[2:]) + "\n")
    return {"root": root, "rows": str(rows), "tok": _tokenizer_dir(root / "tok", CHATML),
            "gen": _tokenizer_dir(root / "gen", GENERATION), "plain": _tokenizer_dir(root / "plain", None)}


def _documents(out):
    """[(ids, mask)] of each prepared document, in order."""
    m, opened = shards.open_prepared(out)
    docs = []
    for shard in opened:
        ids, mask, starts = shard.tokens, shard.loss_mask, shard.doc_starts
        bounds = [int(starts[i]) for i in range(len(starts))] + [shard.n_tokens]
        docs += [(np.asarray(ids[a:b]), np.asarray(mask[a:b])) for a, b in zip(bounds, bounds[1:])]
    return m, docs


def _hf(tok_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tok_dir)


def _ids(encoded):
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def test_each_shape_renders_like_transformers_and_trains_on_assistant_turns_only(chat, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert data_main(["prepare", chat["rows"], "--tokenizer", chat["tok"], "--out", out, "--chat", "--quiet",
                      "--workers", "1"]) == 0
    summary = capsys.readouterr().out
    m, docs = _documents(out)
    assert m["skipped"] == BAD_COUNTS and "skipped 2 bad_json" in summary and "1 no_assistant" in summary
    assert m["loss_mask"]["train_on"] == "assistant" and "loss mask on" in summary
    hf = _hf(chat["tok"])
    eos = hf.convert_tokens_to_ids("<|im_end|>")
    assert m["eos_id"] == eos and len(docs) == len(SHAPES)
    for (ids, mask), (_, turns) in zip(docs, SHAPES):
        want = _ids(hf.apply_chat_template(turns, tokenize=True))
        assert list(ids[:-1]) == want and ids[-1] == eos and mask[-1] == 0  # the appended boundary: no target
        # the targets are exactly each assistant turn (content and its end of turn), nothing else
        answers = "".join(t["content"] + "<|im_end|>\n" for t in turns if t["role"] == "assistant")
        assert hf.decode(ids[mask == 1].tolist()) == answers
        prompt_side = hf.decode(ids[mask == 0].tolist())
        assert all(t["content"] in prompt_side for t in turns if t["role"] != "assistant")
        assert not any(t["content"] in prompt_side for t in turns if t["role"] == "assistant")
    assert m["n_targets"] == sum(int(mk.sum()) for _, mk in docs)
    # The loader: labels are -100 wherever the predicted token is not a target.
    batches = TokenBatches({"name": "tokens", "sources": [{"path": out}], "pack": "documents"}, seq_len=24,
                           micro_batch_size=4, vocab_size=400, seed=0)
    assert batches.masked_labels
    flat_ids = np.concatenate([i for i, _ in docs])
    flat_mask = np.concatenate([mk for _, mk in docs])
    b = batches.batch(0)
    for row_in, row_labels in zip(b["input_ids"].numpy(), b["labels"].numpy()):
        start = next(p for p in range(len(flat_ids)) if np.array_equal(flat_ids[p:p + 24], row_in))
        target = flat_mask[start + 1 : start + 25] == 1
        assert np.array_equal(row_labels[~target], np.full((~target).sum(), -100))
        assert np.array_equal(row_labels[target], flat_ids[start + 1 : start + 25][target])
    assert data_main(["info", out]) == 0
    assert f"loss mask on {100 * m['n_targets'] / m['n_tokens']:.1f}% of the tokens" in capsys.readouterr().out


def test_train_on_last_and_all_and_generation_blocks(chat, tmp_path):
    hf = _hf(chat["gen"])
    rows = tmp_path / "two.jsonl"
    rows.write_text(json.dumps({"messages": MESSAGES}) + "\n" + json.dumps({"messages": MESSAGES[1:3]}) + "\n")
    for train_on in ("last", "all"):
        m, _ = prepare([str(rows)], chat["tok"], str(tmp_path / train_on), chat=True, train_on=train_on, workers=1,
                       show_progress=False)
        _, docs = _documents(str(tmp_path / train_on))
        ids, mask = docs[0]
        if train_on == "last":
            assert hf.decode(ids[mask == 1].tolist()) == A2 + "<|im_end|>\n"
        else:
            assert mask.all()
    # {% generation %} blocks: the mask is transformers' assistant_masks (the block's tokens only)
    prepare([str(rows)], chat["gen"], str(tmp_path / "gen"), chat=True, workers=1, show_progress=False)
    _, docs = _documents(str(tmp_path / "gen"))
    for (ids, mask), turns in zip(docs, (MESSAGES, MESSAGES[1:3])):
        enc = hf.apply_chat_template(turns, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert list(ids[:-1]) == _ids(enc) and list(mask[:-1]) == list(enc["assistant_masks"])


def test_bad_input_is_one_line_before_any_work(chat, tmp_path, capsys):
    def refused(*args):
        out = tmp_path / f"out{len(os.listdir(tmp_path))}"
        assert data_main(["prepare", *args, "--out", str(out), "--quiet", "--workers", "1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("mfsdp-data prepare: error: ") and not out.exists(), err
        return err[0]

    assert "has no chat template" in refused(chat["rows"], "--tokenizer", chat["plain"], "--chat")
    assert "--train-on: applies to conversations only" in refused(chat["rows"], "--tokenizer", chat["tok"],
                                                                  "--train-on", "last")
    text = tmp_path / "notes.txt"
    text.write_text("plain text")
    assert "--chat reads conversations from JSON lines" in refused(str(text), "--tokenizer", chat["tok"], "--chat")
    only_bad = tmp_path / "bad.jsonl"
    only_bad.write_text("\n".join(BAD) + "\n")
    assert "no conversation to train on" in refused(str(only_bad), "--tokenizer", chat["tok"], "--chat")


def test_a_mask_stream_that_does_not_match_its_tokens_is_refused(tmp_path):
    from helpers import write_masked_corpus
    from mfsdp_launch.corpus import check_integrity, check_sources

    docs = [np.array([5, 6, 7, EOS]), np.array([8, 9, EOS])]
    path = write_masked_corpus(tmp_path / "c", docs, [np.array([0, 1, 1, 0], np.uint8), np.array([0, 1, 0], np.uint8)])
    mask_file = os.path.join(path, "shard_000000.mask")
    with open(mask_file, "ab") as f:
        f.write(b"\x01")  # one mask byte too many
    with pytest.raises(ConfigError) as e:
        check_integrity([{"path": path}])
    assert "shard_000000.mask" in str(e.value) and "\n" not in str(e.value)
    manifest = json.loads(open(os.path.join(path, "manifest.json")).read())
    manifest["shards"][0]["files"]["mask"]["bytes"] += 1  # a manifest that agrees with the longer file
    shards.write_manifest(path, manifest)
    with pytest.raises(ConfigError) as e:
        check_sources([{"path": path}])
    assert "8 mask bytes for 7 tokens" in str(e.value)


def test_the_launcher_refuses_a_loss_mask_with_a_captured_step(tmp_path):
    from helpers import refused, write_masked_corpus

    path = write_masked_corpus(tmp_path / "c", [np.arange(1, 40) % 200] * 4, [np.ones(39, np.uint8)] * 4)
    e = refused("model=gpt", "model.preset=tiny", "data=tokens", f"data.sources=[{{path: '{path}'}}]",
                "train.seq_len=16", "engine=megatron_fsdp", "optim.impl=te_fused", "train.cuda_graph=full_iteration",
                "train.grad_accum_steps=1")
    assert str(e).startswith("train.cuda_graph: full_iteration replays one fixed step, but data.sources[0] has a "
                             "loss mask") and "\n" not in str(e)
