"""Shell completion through Hydra's own plugin (as an `@hydra.main` app's --shell-completion):

    eval "$(mfsdp-train --shell-completion install=bash)"   # then TAB completes groups and keys

`install=bash` prints the bash function; the function asks `mfsdp-train -sc query=bash` (with
COMP_LINE set) for the candidates: config groups and their options (+recipe=...), and keys.
"""

from __future__ import annotations

import contextlib
import io
import sys
from typing import List

from ..core.errors import ConfigError

FLAGS = ("--shell-completion", "-sc")
APP = "mfsdp-train"  # the installed command the completion is bound to


def completion_args(argv: List[str]) -> List[str]:
    """The subcommand (install=bash, uninstall=bash, query=bash) after --shell-completion/-sc."""
    for i, a in enumerate(argv):
        if a.startswith("--shell-completion="):
            return [a.split("=", 1)[1]]
        if a in FLAGS:
            return argv[i + 1:i + 2]
    return []


def shell_completion(args: List[str]) -> None:
    """Run Hydra's completion plugin for `args`; ConfigError for a bad subcommand."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from ..planner.compose import config_dir, register_schema

    if len(args) != 1 or args[0].split("=", 1)[0] not in ("install", "uninstall", "query"):
        raise ConfigError("--shell-completion", f"{' '.join(args) or 'nothing'}: not a subcommand",
                          "install=bash|uninstall=bash|query=bash (and zsh, fish)")
    register_schema()
    GlobalHydra.instance().clear()
    out = io.StringIO()
    argv0, sys.argv[0] = sys.argv[0], APP  # the plugin binds the completion to sys.argv[0]'s name
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            with contextlib.redirect_stdout(out):
                GlobalHydra.instance().hydra.shell_completion(config_name="config", overrides=list(args))
    except ValueError:  # Hydra's word for a shell it has no plugin for
        raise ConfigError("--shell-completion", f"{args[0]}: no completion for that shell", "bash|zsh|fish") from None
    finally:
        sys.argv[0] = argv0
        GlobalHydra.instance().clear()
    text = out.getvalue()
    print(_without_schema_nodes(text) if args[0].startswith("query=") else text, end="")


def _without_schema_nodes(text: str) -> str:
    """The candidates but the typed sections the schema registers in the groups (engine=FSDP2Config):
    they are not options a user picks."""
    from ..engines import ENGINES
    from ..models import sections

    nodes = {c.section.__name__ for c in ENGINES.values()} | {s.__name__ for s in sections().values()}
    return " ".join(w for w in text.split() if not ("=" in w and w.rsplit("=", 1)[1] in nodes)) + "\n"
