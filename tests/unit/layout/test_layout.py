"""The package's shape, checked on the source so that a new circle, an upward import or a grown
module fails here, not in review: no import circles (imports inside functions count), every import
points down or sideways on the floor plan, the rank process never imports the launcher's modules,
no module past 500 lines, few loose modules at the top, and no family named outside models/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from helpers import ROOT

PACKAGE = ROOT / "mfsdp_launch"
MAX_MODULE_LINES = 500
MAX_LOOSE_MODULES = 10

# The floor plan, lowest first: a module imports its own floor or lower ones, never a higher one.
FLOORS = (
    ("core",),  # the vocabulary (schema, enums, dtypes, errors) and primitives: imports nothing above
    ("mesh", "corpus", "components"),  # ParallelDims; token corpora; precision, optim, rng, metrics...
    ("models", "data", "engines", "checkpoint"),  # families; batches; FSDP2 / Megatron-FSDP; DCP
    ("planner",),  # compose, resolve, validate, machine, memory, dry run: asks every layer below
    ("rank",),  # the rank process: runtime, loop, worker, stopping, watchdog, oom
    ("launcher", "tools"),  # the launcher process (cli, launch, supervise, sweep, slurm); report, export
)


def modules() -> dict:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imports_of(name: str, path: Path, known: dict) -> set:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known and "." in t:
                t = t.rsplit(".", 1)[0]
            # A module importing its own package (`from . import x` in a/b.py -> a) is not an edge.
            if t in known and t != name and not name.startswith(t + "."):
                found.add(t)
    return found


def cycles(graph: dict) -> list:
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    assert cycles(graph) == []


def test_the_checker_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]


def test_no_module_is_too_long():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def room(name: str) -> str:
    """The top-level package (or loose module) a module lives in: mfsdp_launch.rank.loop -> rank."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def floor_of(name: str) -> int:
    for level, rooms in enumerate(FLOORS):
        if room(name) in rooms:
            return level
    return len(FLOORS)  # the package itself and __main__: the entry points, above everything


def graph() -> dict:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_every_room_is_on_the_floor_plan():
    rooms = {room(name) for name in modules()} - {"", "__main__"}
    assert rooms <= {r for floor in FLOORS for r in floor}


def test_imports_point_down_or_sideways():
    upward = sorted(f"{a} -> {b}" for a, targets in graph().items() for b in targets if floor_of(b) > floor_of(a))
    assert upward == []


def test_the_ground_floor_imports_nothing_above_it():
    above = sorted(f"{a} -> {b}" for a, targets in graph().items() if room(a) == "core"
                   for b in targets if room(b) != "core")
    assert above == []


def test_the_rank_process_never_imports_the_launcher():
    crossing = sorted(f"{a} -> {b}" for a, targets in graph().items() if room(a) == "rank"
                      for b in targets if room(b) == "launcher")
    assert crossing == []


def test_few_loose_modules_at_the_top():
    loose = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(loose) <= MAX_LOOSE_MODULES, loose


FAMILY_NAMES = ("gpt", "te_gpt", "custom", "hf", "toy_cnn", "toy_transformer", "te_toy_transformer")
_NAMES = "|".join(FAMILY_NAMES)
# `x == "gpt"`, `in ("gpt", ...)`, `.startswith("te_")`, `"gpt" in x`.
FAMILY_COMPARISON = re.compile(
    rf"""(==|!=|\bin|startswith\()\s*\(?\s*["']({_NAMES}|te_)["']|["']({_NAMES})["']\s*(==|!=|in\b)""")
ISINSTANCE_FAMILY = re.compile(r"isinstance\([^)]*Family\b")


def test_no_family_is_named_outside_models():
    """Outside models/ a family is asked what it can do; its name is never compared."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        if "models" in path.relative_to(PACKAGE).parts[:1]:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if FAMILY_COMPARISON.search(line) or ISINSTANCE_FAMILY.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert found == []


def test_the_family_name_checker_finds_a_comparison(tmp_path):
    assert FAMILY_COMPARISON.search('if cfg.model.name == "gpt":')
    assert FAMILY_COMPARISON.search("if name.startswith('te_'):")
    assert FAMILY_COMPARISON.search('if m.name in ("gpt", "te_gpt"):')
    assert not FAMILY_COMPARISON.search('name = "gpt"')
