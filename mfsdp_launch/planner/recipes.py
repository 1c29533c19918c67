"""The recipes: recipes/NAME.yaml is `+recipe=NAME`, and its first comment line (after Hydra's
`# @package` directive) is its one-line purpose, which `--help` lists. Torch-free."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, Iterable, List

from .compose import config_dir

GROUP = "recipe"


def recipe_dirs(extra: Iterable[str] = ()) -> List[Path]:
    """The packaged recipes' folder, then each --config-dir's recipe/ folder."""
    return [config_dir() / GROUP, *(Path(d) / GROUP for d in extra)]


def purpose(path: Path) -> str:
    """The first comment line of a recipe that is not a Hydra directive; "" when it has none."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        text = line.strip()
        if not text.startswith("#"):
            if text:
                break  # the YAML has begun: no leading comment
            continue
        text = text.lstrip("#").strip()
        if text and not text.startswith("@"):
            return text
    return ""


def recipes(extra_dirs: Iterable[str] = ()) -> Dict[str, str]:
    """{name: purpose} of every recipe (a --config-dir recipe of the same name wins, as in Hydra)."""
    found: Dict[str, str] = {}
    for folder in recipe_dirs(extra_dirs):
        for p in sorted(folder.glob("*.yaml")) if folder.is_dir() else []:
            found[p.stem] = purpose(p)
    return dict(sorted(found.items()))


def recipes_help() -> str:
    """The --help section: one line per recipe, its name and purpose."""
    table = recipes()
    pad = max((len(n) for n in table), default=0) + 2
    lines = ["recipes (+recipe=NAME; each one's purpose is the first comment line of recipes/NAME.yaml):"]
    lines += [f"  {name.ljust(pad)}{text}".rstrip() for name, text in table.items()]
    return "\n".join(lines) + "\n"
