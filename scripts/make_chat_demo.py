"""A chat data set and a tokenizer directory with a chat template, made on this machine (nothing is
downloaded), for the README's "Supervised fine-tuning" walk-through:

    python3 scripts/make_chat_demo.py demo      # -> demo/chat.jsonl, demo/chat-tokenizer/

The conversations ask what a function of the Python standard library does and answer with the
first paragraph of its docstring, in the three shapes `mfsdp-data prepare --chat` reads (messages,
prompt/completion, ShareGPT), plus a few rows it must count and skip. The tokenizer is a byte-level
BPE trained on those texts with ChatML's <|im_start|>/<|im_end|> and a ChatML chat template in its
tokenizer_config.json, so `transformers.AutoTokenizer` loads the same directory.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
from pathlib import Path

MODULES = ("json", "os.path", "shutil", "textwrap", "itertools", "functools", "collections", "string", "re",
           "math", "statistics", "random", "pathlib", "tempfile", "datetime", "heapq", "bisect", "zlib", "base64")
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SYSTEM = "You answer questions about the Python standard library in one paragraph."


def pairs():
    """(question, answer) for every documented public function or class of MODULES."""
    for name in MODULES:
        module = importlib.import_module(name)
        for attr, obj in sorted(vars(module).items()):
            if attr.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            doc = inspect.getdoc(obj) or ""
            answer = doc.split("\n\n")[0].replace("\n", " ").strip()
            if 20 <= len(answer) <= 600:
                yield f"What does {name}.{attr} do?", answer


def rows(qa):
    for i, (q, a) in enumerate(qa):
        if i % 3 == 0:
            yield {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q},
                                {"role": "assistant", "content": a}]}
        elif i % 3 == 1:
            yield {"prompt": q, "completion": a}
        else:
            yield {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}], "system": SYSTEM}
    yield {"messages": [{"role": "user", "content": "A question nobody answered."}]}  # counted: no_assistant


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory for chat.jsonl and chat-tokenizer/")
    parser.add_argument("--vocab", type=int, default=2048)
    a = parser.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tokenizers import Tokenizer

    from mfsdp_launch.corpus.tokenizer import train_bpe

    out = Path(a.out)
    tok_dir = out / "chat-tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    qa = list(pairs())
    with open(out / "chat.jsonl", "w", encoding="utf-8") as f:
        for row in rows(qa):
            f.write(json.dumps(row) + "\n")
        f.write("{a line cut short\n")  # counted: bad_json
    train_bpe([SYSTEM] + [f"user\n{q}\nassistant\n{ans}" for q, ans in qa], a.vocab, str(tok_dir / "tokenizer.json"))
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(tok_dir / "tokenizer.json"))
    config = {"chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    print(f"{out / 'chat.jsonl'}: {len(qa)} conversations (+2 bad rows); {tok_dir}: "
          f"{tok.get_vocab_size(with_added_tokens=True)} tokens, ChatML template")
    return 0


if __name__ == "__main__":
    sys.exit(main())
