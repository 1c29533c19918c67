"""Chat data for ``mfsdp-data prepare --chat``: conversations rendered with a local tokenizer's
chat template, with the character spans the loss trains on.

Row shapes (JSON lines), each normalized to ``[{role, content}]``:

* ``{"messages": [{"role": ..., "content": ...}, ...]}`` (OpenAI / HF chat);
* ``{"prompt": ..., "completion": ...}``: strings (a user turn and an assistant turn) or lists of
  messages (TRL's conversational prompt-completion);
* ShareGPT ``{"conversations": [{"from": "human"|"gpt"|"system", "value": ...}], "system": ...}``.

The template is the tokenizer directory's ``chat_template.jinja`` or ``tokenizer_config.json``'s
``chat_template`` (``--chat-template FILE`` overrides both), rendered as transformers'
``apply_chat_template`` renders it (the same sandboxed jinja environment and globals; nothing is
downloaded, transformers is not needed). Which characters are targets (``--train-on``):

* ``assistant`` (default): every assistant turn, from where the template's generation prompt
  ends to the end of the turn (its end-of-turn token included: the model learns to stop);
* ``last``: the last assistant turn only;
* ``all``: every character of the rendered conversation.

A template with ``{% generation %}`` blocks marks the assistant text itself, and those blocks
are used. Otherwise turn ``i``'s span runs from ``render(messages[:i], add_generation_prompt)``
to ``render(messages[:i + 1])``, which needs a template whose renders of a conversation's
prefixes are prefixes of its full render; a row where that fails is counted
(``unstable_template``), as is every other bad row (see ROW_PROBLEMS): nothing is dropped silently.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..core.errors import ConfigError

TRAIN_ON = ("assistant", "last", "all")
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
# ShareGPT's speaker names, and the roles a template knows.
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "gpt": "assistant",
         "tool": "tool"}
# What a bad row is counted as (the manifest's "skipped", the summary line).
ROW_PROBLEMS = {
    "bad_json": "a line that is not a JSON object",
    "no_messages": "none of messages, conversations, prompt+completion",
    "bad_message": "a turn without a string role/from or content/value",
    "bad_role": "a role other than " + "|".join(sorted(ROLES)),
    "no_assistant": "no assistant turn to train on",
    "template_error": "the chat template raised an error",
    "unstable_template": "the template renders a prefix of the conversation differently",
}
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class RowProblem(Exception):
    """A row that cannot be trained on; ``kind`` is its ROW_PROBLEMS key."""

    def __init__(self, kind: str):
        super().__init__(kind)
        self.kind = kind


# ----------------------------------------------------------------------------- rows


def _turn(m: Any) -> Dict[str, Any]:
    if not isinstance(m, dict):
        raise RowProblem("bad_message")
    role = m.get("role", m.get("from"))
    content = m.get("content", m.get("value"))
    if not isinstance(role, str) or not isinstance(content, str):
        raise RowProblem("bad_message")
    if role.lower() not in ROLES:
        raise RowProblem("bad_role")
    turn = {k: v for k, v in m.items() if k not in ("from", "value")}
    turn.update(role=ROLES[role.lower()], content=content)
    return turn


def _turns(value: Any) -> List[Dict[str, Any]]:
    if isinstance(value, str):
        raise RowProblem("bad_message")
    if not isinstance(value, list) or not value:
        raise RowProblem("no_messages")
    return [_turn(m) for m in value]


def conversation(row: Any, field: Optional[str] = None) -> List[Dict[str, Any]]:
    """The row's turns as ``[{role, content, ...}]``; RowProblem for a row that has none usable.
    ``field`` names the key holding the turns (default: messages, then conversations)."""
    if not isinstance(row, dict):
        raise RowProblem("bad_json")
    if field:
        if field not in row:
            raise RowProblem("no_messages")
        turns = _turns(row[field])
    elif "messages" in row:
        turns = _turns(row["messages"])
    elif "conversations" in row:
        turns = _turns(row["conversations"])
    elif "prompt" in row and "completion" in row:
        p, c = row["prompt"], row["completion"]
        if isinstance(p, str) and isinstance(c, str):
            turns = [{"role": "user", "content": p}, {"role": "assistant", "content": c}]
        else:
            turns = _turns(p) + _turns(c)
    else:
        raise RowProblem("no_messages")
    system = row.get("system")
    if isinstance(system, str) and system and turns[0]["role"] != "system":
        turns = [{"role": "system", "content": system}] + turns
    if not any(t["role"] == "assistant" for t in turns):
        raise RowProblem("no_assistant")
    return turns


# ------------------------------------------------------------------------- template


@dataclass(frozen=True)
class ChatTemplate:
    text: str
    source: str  # the file it came from
    special: Dict[str, str]  # bos_token, eos_token, ... as the template sees them

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def marks_generation(self) -> bool:
        import re

        return re.search(r"\{%-?\s*generation\s*-?%\}", self.text) is not None


def _token_text(value: Any) -> Optional[str]:
    if isinstance(value, dict):  # an AddedToken as tokenizer_config.json stores it
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_config(tokenizer_dir: str) -> Dict[str, Any]:
    path = os.path.join(tokenizer_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, "r", encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError("--tokenizer", f"cannot read {path}: {e}") from None
    return cfg if isinstance(cfg, dict) else {}


def load_template(tokenizer: str, override: Optional[str] = None) -> ChatTemplate:
    """The chat template of a local tokenizer (a directory, or the tokenizer.json inside one);
    one ConfigError line when there is none."""
    tokenizer_dir = tokenizer if os.path.isdir(tokenizer) else os.path.dirname(os.path.abspath(tokenizer))
    cfg = _read_config(tokenizer_dir)
    special = {k: t for k in SPECIAL_TOKENS if (t := _token_text(cfg.get(k))) is not None}
    if override:
        if not os.path.isfile(override):
            raise ConfigError("--chat-template", f"{override!r} is not a file", "a Jinja chat template file")
        with open(override, "r", encoding="utf-8") as f:
            return ChatTemplate(f.read(), os.path.abspath(override), special)
    jinja = os.path.join(tokenizer_dir, TEMPLATE_FILE)
    if os.path.isfile(jinja):
        with open(jinja, "r", encoding="utf-8") as f:
            return ChatTemplate(f.read(), jinja, special)
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template.strip():
        raise ConfigError("--tokenizer", f"{tokenizer_dir} has no chat template (no {TEMPLATE_FILE}, and no "
                          f"chat_template in {CONFIG_FILE})", "a tokenizer directory with one, or --chat-template FILE")
    return ChatTemplate(template, os.path.join(tokenizer_dir, CONFIG_FILE), special)


def compile_template(text: str):
    """The template compiled in transformers' environment for chat templates (sandboxed jinja,
    trim_blocks/lstrip_blocks, loop controls, tojson, raise_exception, strftime_now, and a
    `generation` block that records the spans it renders)."""
    import datetime

    try:
        import jinja2
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ConfigError("--chat", "needs jinja2 (pip install jinja2)") from None

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            # A marker pair around the block's text; Renderer.render takes them out and keeps the spans.
            return f"\x00{caller()}\x01"

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(text)
    except jinja2.exceptions.TemplateError as e:
        raise ConfigError("--chat-template", f"the chat template does not compile: {e}") from None


class Renderer:
    """Renders conversations and finds the spans the loss trains on (see the module docstring)."""

    def __init__(self, template: ChatTemplate, train_on: str = "assistant"):
        if train_on not in TRAIN_ON:
            raise ConfigError("--train-on", f"unknown {train_on!r}", TRAIN_ON)
        self.template, self.train_on = template, train_on
        self.compiled = compile_template(template.text)

    def render(self, turns: Sequence[Dict[str, Any]], add_generation_prompt: bool = False) -> Tuple[str, List[tuple]]:
        """(text, the spans of its `generation` blocks)."""
        try:
            raw = self.compiled.render(messages=list(turns), tools=None, documents=None,
                                       add_generation_prompt=add_generation_prompt, **self.template.special)
        except Exception:  # noqa: BLE001 - raise_exception, a template bug: this row's problem
            raise RowProblem("template_error") from None
        text, spans, start = [], [], None
        pos = 0
        for ch in raw:
            if ch == "\x00":
                start = pos
            elif ch == "\x01":
                spans.append((start, pos))
            else:
                text.append(ch)
                pos += 1
        return "".join(text), spans

    def spans(self, turns: Sequence[Dict[str, Any]]) -> Tuple[str, List[Tuple[int, int]]]:
        """(the rendered conversation, the character spans the loss trains on)."""
        full, marked = self.render(turns)
        if self.train_on == "all":
            return full, [(0, len(full))]
        assistant = [i for i, t in enumerate(turns) if t["role"] == "assistant"]
        if self.template.marks_generation:
            spans = marked
        else:
            spans = []
            for i in assistant:
                before, _ = self.render(turns[:i], add_generation_prompt=True)
                upto, _ = self.render(turns[: i + 1])
                if not (upto.startswith(before) and full.startswith(upto)):
                    raise RowProblem("unstable_template")
                spans.append((len(before), len(upto)))
        if not spans:
            raise RowProblem("no_assistant")
        return full, spans[-1:] if self.train_on == "last" else spans


def token_mask(offsets: Sequence[Tuple[int, int]], spans: Sequence[Tuple[int, int]]):
    """uint8 per token: 1 where the token starts inside a span (tokenizers' character offsets)."""
    import numpy as np

    starts = np.fromiter((o[0] for o in offsets), dtype=np.int64, count=len(offsets))
    mask = np.zeros(len(offsets), dtype=np.uint8)
    for a, b in spans:
        mask[(starts >= a) & (starts < b)] = 1
    return mask
