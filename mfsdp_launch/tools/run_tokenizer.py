"""The tokenizer a run trained with, found from what its config recorded, or given (`--tokenizer`).

Where it comes from, first match:

* `--tokenizer PATH`;
* a Hugging Face directory being generated from: its own tokenizer files;
* `data=text`: `data.tokenizer`, or raw bytes (ids 0-255) when it is null, as the run trained;
* `data=tokens`: the tokenizer file each prepared source's manifest.json records (its sha256 checked);
* otherwise the model's own directory, if it has one (a `model=hf` run's `model.path`).

A path is a directory with a `tokenizer_config.json` (transformers' AutoTokenizer, which carries a
chat template), or a `tokenizer.json` (the `tokenizers` library, as `mfsdp-data prepare`; one with
a `tokenizer_config.json` beside it loads as that directory). Anything else (`data=synthetic`
without a model directory, a recorded file that is gone or changed) is one ConfigError.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

from ..core.errors import ConfigError

HF_TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_JSON = "tokenizer.json"


class Codec:
    """Text <-> token ids. `eos_id` is None when the tokenizer has no end-of-text token."""

    name = "tokenizer"
    eos_id: Optional[int] = None

    def encode(self, text: str) -> List[int]:
        raise NotImplementedError

    def decode(self, ids: List[int]) -> str:
        raise NotImplementedError

    def chat(self, prompt: str) -> List[int]:
        raise ConfigError("--chat", f"needs a chat template, and {self.name} has none; give --tokenizer DIR, a "
                          f"Hugging Face tokenizer directory whose {HF_TOKENIZER_CONFIG} holds a chat_template")


class ByteCodec(Codec):
    """data=text without a tokenizer: UTF-8 bytes are the ids."""

    name = "the byte tokenizer (data.tokenizer=null)"

    def encode(self, text: str) -> List[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: List[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class TokenizersCodec(Codec):
    def __init__(self, path: str):
        from ..corpus import tokenizer as tk

        self.name = path
        self.tok = tk.load(path, key="--tokenizer")
        self.eos_id = next((self.tok.token_to_id(t) for t in tk.EOS_CANDIDATES if self.tok.token_to_id(t) is not None),
                           None)

    def encode(self, text: str) -> List[int]:
        return self.tok.encode(text).ids

    def decode(self, ids: List[int]) -> str:
        return self.tok.decode(ids)


class HFCodec(Codec):
    def __init__(self, path: Path):
        from ..models.hf.model import import_transformers

        self.name = str(path)
        try:
            self.tok = import_transformers("--tokenizer").AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise ConfigError("--tokenizer", f"{path}: {str(exc).splitlines()[0][:200]}") from None
        self.eos_id = self.tok.eos_token_id

    def encode(self, text: str) -> List[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: List[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def chat(self, prompt: str) -> List[int]:
        if not getattr(self.tok, "chat_template", None):
            return super().chat(prompt)
        text = self.tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                            add_generation_prompt=True)
        return self.encode(text)


def from_path(path: str) -> Codec:
    p = Path(path).expanduser()
    folder = p if p.is_dir() else p.parent
    if (folder / HF_TOKENIZER_CONFIG).is_file() and (p.is_dir() or p.name == TOKENIZER_JSON):
        return HFCodec(folder)
    return TokenizersCodec(str(p))


def for_run(config: dict, hf_dir: Optional[Path], override: Optional[str], key: str = "RUN") -> Codec:
    """The Codec of a run's config (or of an HF directory); see the module docstring for the order."""
    if override:
        return from_path(override)
    if hf_dir is not None:
        return _own(hf_dir, key)
    data = config.get("data") or {}
    name = str(data.get("name"))
    if name == "text":
        return from_path(data["tokenizer"]) if data.get("tokenizer") else ByteCodec()
    if name == "tokens":
        return _recorded(data.get("sources") or [], key)
    if config.get("model"):
        from ..models import family, section_from

        model_cfg = section_from(config["model"])
        own = family(str(model_cfg.name)).tokenizer_dir(model_cfg)
        if own:
            return _own(Path(own).expanduser(), key)
    raise ConfigError(key, f"the run trained on data={name}, which has no tokenizer; give --tokenizer")


def _own(folder: Path, key: str) -> Codec:
    if (folder / HF_TOKENIZER_CONFIG).is_file() or (folder / TOKENIZER_JSON).is_file():
        return HFCodec(folder)
    raise ConfigError(key, f"{folder} holds no tokenizer ({HF_TOKENIZER_CONFIG} or {TOKENIZER_JSON}); "
                      "give --tokenizer")


def _recorded(sources: list, key: str) -> Codec:
    """The tokenizer file recorded by the first prepared source (`mfsdp-data prepare`'s manifest)."""
    from ..corpus.tokenizer import file_sha256

    for src in sources:
        manifest = Path(str((src or {}).get("path") or "")).expanduser() / "manifest.json"
        if not manifest.is_file():
            continue
        tok = (json.loads(manifest.read_text()).get("tokenizer") or {})
        file = tok.get("file")
        if not file or not Path(file).is_file():
            raise ConfigError(key, f"the run's tokenizer {file!r} (recorded in {manifest}) is not there; "
                              "give --tokenizer")
        if tok.get("sha256") and file_sha256(file) != tok["sha256"]:
            raise ConfigError(key, f"{file} changed since {manifest} was prepared with it (sha256); give --tokenizer")
        return from_path(file)
    raise ConfigError(key, "the run's data.sources record no tokenizer (no prepared manifest.json); "
                      "give --tokenizer")
