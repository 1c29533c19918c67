"""`mfsdp-train ... --cfg`: the composed config as YAML, and beside each value the planner derives
(planner/resolve.py: dp_shard=-1, nproc_per_node=auto, dp_outer=nodes, null dtypes; the model
family's dims from its preset) what it resolves to, as a `# resolved: VALUE` comment. What was
asked stays as it was written: the comment shows what the run would use. Torch-free."""

from __future__ import annotations

import copy
import re
from typing import Any, List, Optional

from omegaconf import OmegaConf

from ..core.errors import ConfigError

_KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[^\s:#'\"-][^:]*):(?P<value> .*)?$")
_MISSING = object()


def _dig(tree: Any, path: List[str]) -> Any:
    for part in path:
        if not isinstance(tree, dict) or part not in tree:
            return _MISSING
        tree = tree[part]
    return tree


def _text(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def resolved_tree(cfg) -> tuple[Optional[dict], Optional[str]]:
    """(the config as the planner resolves it, None) or (None, why it cannot be resolved)."""
    from .resolve import resolve

    done = copy.deepcopy(cfg)
    try:
        resolve(done)
    except ConfigError as exc:
        return None, str(exc)
    tree = OmegaConf.to_container(done, resolve=True)
    try:  # the family's dims (a preset's dim, n_layers, ...): what the model is built with
        from ..models import family

        shape = family(str(done.model.name)).shape(done.model)
    except Exception:  # noqa: BLE001 - an invalid model is validation's business, not --cfg's
        shape = None
    for key, value in (shape or {}).items():
        if key in tree["model"] and tree["model"][key] is None:
            tree["model"][key] = value
    return tree, None


def annotated_yaml(cfg) -> str:
    """OmegaConf.to_yaml(cfg), with `# resolved: VALUE` after each value that resolves to another."""
    asked = OmegaConf.to_container(cfg, resolve=True)
    resolved, why = resolved_tree(cfg)
    text = OmegaConf.to_yaml(cfg)
    if resolved is None:
        return text + f"# not resolved: {why}\n"
    out, stack = [], []  # stack: (indent, key) of the mappings the line is inside
    for line in text.splitlines():
        m = _KEY_LINE.match(line)
        if m:
            indent, key = len(m.group("indent")), m.group("key").strip()
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = [k for _, k in stack] + [key]
            if not (m.group("value") or "").strip():
                stack.append((indent, key))  # a mapping (or an empty value) opens here
            else:
                now, then = _dig(asked, path), _dig(resolved, path)
                if then is not _MISSING and not isinstance(then, (dict, list)) and then != now:
                    line += f"  # resolved: {_text(then)}"
        out.append(line)
    head = "# the composed config; `# resolved: X` marks a value the planner fills in: the run uses X\n"
    return (head if any("  # resolved: " in ln for ln in out) else "") + "\n".join(out) + "\n"
