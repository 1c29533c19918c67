"""Config composition: Hydra groups + recipes + overrides -> one typed, resolved config.

Composition happens once, in the launcher. Workers load the frozen `config.yaml` with
`load_frozen`; they never re-compose, so nothing (a `${now:}`, a changed file) can make two
ranks see different configs.
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import Iterable, List, Optional

from omegaconf import DictConfig, OmegaConf

from ..core import rundir
from ..core.atomic_io import atomic_write_text
from ..core.errors import ConfigError
from ..core.names import first_line
from ..core.schema import Config
from ..engines import ENGINES, engine_caps
from ..models import section_of, sections

SCHEMA_NAME = "mfsdp_schema"


def config_dir() -> Path:
    """The config root: inside the installed package, or `configs/` of a source checkout."""
    package = Path(__file__).resolve().parent.parent
    packaged = package / "configs"
    if (packaged / "config.yaml").is_file():
        return packaged
    source = package.parent / "configs"
    if (source / "config.yaml").is_file():
        return source
    raise RuntimeError(f"mfsdp-launch configs not found (looked in {packaged} and {source})")


@functools.lru_cache(maxsize=None)
def register_schema() -> None:
    """The typed schema, and each config group option's own section (Hydra's structured-config
    groups): configs/model/gpt.yaml starts from GPTModelConfig, so a key that family does not read
    is unknown there. Once a process: the store keeps them and hands out deep copies."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name=SCHEMA_NAME, node=Config)
    for name, section in sections().items():
        store.store(group="model", name=name, node=section)
    for caps in ENGINES.values():
        store.store(group="engine", name=caps.section.__name__, node=caps.section)


def available_options(group: str) -> List[str]:
    folder = config_dir() / group
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def compose(overrides: Iterable[str]) -> DictConfig:
    """Compose the typed config for these command-line overrides; bad input raises ConfigError."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    overrides = list(overrides)
    register_schema()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
            cfg = hydra_compose(config_name="config", overrides=overrides)
    except Exception as exc:  # Hydra and OmegaConf raise many types; all mean bad input here.
        raise config_error_from(exc, overrides) from None
    finally:
        GlobalHydra.instance().clear()
    return finalize(cfg)


def finalize(cfg: DictConfig) -> DictConfig:
    """Resolve interpolations and re-check the result against the schema."""
    cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg
    try:
        container = OmegaConf.to_container(cfg, resolve=True)
        typed = OmegaConf.merge(_schema_for(container), container)  # merge copies the schema
    except ConfigError:  # an unknown model or engine name: already one line naming its key
        raise
    except Exception as exc:
        raise config_error_from(exc) from None
    OmegaConf.set_struct(typed, True)
    return typed


def typed_schema(container: dict) -> DictConfig:
    """The schema with each section typed by what the config chose (the model family's section):
    a new object the caller may change."""
    return copy.deepcopy(_schema_for(container))


def _schema_for(container: dict) -> DictConfig:
    """The cached typed schema for `container`'s model and engine; never to be changed."""
    fields = Config.__dataclass_fields__
    model = (container.get("model") or {}).get("name", fields["model"].default_factory().name)
    engine = (container.get("engine") or {}).get("name", fields["engine"].default_factory().name)
    return _typed_schema(str(model), str(engine))


@functools.lru_cache(maxsize=None)
def _typed_schema(model: str, engine: str) -> DictConfig:
    # Building it is a fifth of a compose; OmegaConf.merge copies its first argument, so the
    # cached object is never changed by a caller that merges into it.
    schema = OmegaConf.structured(Config)
    return OmegaConf.merge(schema, {"model": OmegaConf.structured(section_of(model)),
                                    "engine": OmegaConf.structured(engine_caps(engine).section)})


def load_frozen(path: str | Path) -> DictConfig:
    """Load a frozen config.yaml written by the launcher, typed against the schema."""
    return finalize(OmegaConf.load(str(path)))


def save_frozen(cfg: DictConfig, run_dir: Path, overrides: Optional[List[str]] = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / rundir.CONFIG
    atomic_write_text(target, OmegaConf.to_yaml(cfg, resolve=True))
    if overrides is not None:
        (run_dir / rundir.OVERRIDES).write_text(OmegaConf.to_yaml(OmegaConf.create(list(overrides))))
    return target


# --- turning Hydra/OmegaConf failures into one clear line -------------------------------------


def _schema_keys(dotted_parent: str) -> List[str]:
    node = OmegaConf.structured(Config)
    for part in [p for p in dotted_parent.split(".") if p]:
        if not isinstance(node, DictConfig) or part not in node:
            return []
        node = node[part]
    return list(node.keys()) if isinstance(node, DictConfig) else []


def _section_keys(object_type) -> List[str]:
    """The keys of the typed section an unknown key was set on (a family's section, say)."""
    import dataclasses

    return [f.name for f in dataclasses.fields(object_type)] if dataclasses.is_dataclass(object_type) else []


def unknown_key_problem(key: str, section) -> str:
    """"unknown key", naming the families that read it when it is another family's key (a recipe
    written for one family may set it: `+recipe=cpu_smoke model=custom model.preset=...`)."""
    from ..models import FAMILIES

    group, _, leaf = key.partition(".")
    if group != "model" or "." in leaf:
        return "unknown key"
    owners = [n for n, f in FAMILIES.items() if leaf in _section_keys(f.section)]
    readers = [n for n, f in FAMILIES.items() if f.section is section]
    if not owners or not readers:
        return "unknown key"
    return f"model={'|'.join(readers)} does not read it (a key of model={'|'.join(owners)})"


def _find_entry(obj, key: str, path: str) -> Optional[str]:
    """The path (`data.sources[1]`) of the first list entry in `obj` that has `key`."""
    if isinstance(obj, list):
        for i, item in enumerate(obj):
            if isinstance(item, dict) and key in item:
                return f"{path}[{i}]"
            found = _find_entry(item, key, f"{path}[{i}]")
            if found:
                return found
    elif isinstance(obj, dict):
        for k, v in obj.items():
            found = _find_entry(v, key, f"{path}.{k}" if path else str(k))
            if found:
                return found
    return None


def _search_dirs(overrides: Iterable[str]) -> List[Path]:
    dirs = [config_dir()]
    for o in overrides:
        m = re.match(r"^hydra\.searchpath=\[(.*)\]$", o)
        if m:
            dirs += [Path(e.strip()[len("file://"):]) for e in m.group(1).split(",") if e.strip().startswith("file://")]
    return dirs


def list_entry_key(key: str, text: str, overrides: Iterable[str]) -> Optional[str]:
    """`data.sources[1].wieght` for an unknown key inside a list entry, which OmegaConf names by
    its leaf alone: the entry is looked up in the overrides, then in the config file Hydra names."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    overrides = list(overrides)
    parser = OverridesParser.create()
    for o in overrides:
        try:
            override = parser.parse_override(o)
            found = _find_entry(override.value(), key, override.key_or_group.lstrip("+~"))
        except Exception:  # noqa: BLE001 - an override Hydra cannot read is reported on its own
            continue
        if found:
            return f"{found}.{key}"
    m = re.search(r"In '([\w/.-]+)'", text)
    for folder in _search_dirs(overrides) if m else []:
        path = folder / f"{m.group(1)}.yaml"
        if not path.is_file():
            continue
        try:
            data = OmegaConf.to_container(OmegaConf.load(path))
        except Exception:  # noqa: BLE001
            return None
        package = "" if "@package _global_" in path.read_text() else m.group(1).split("/")[0]
        found = _find_entry(data, key, package)
        return f"{found}.{key}" if found else None
    return None


def config_error_from(exc: BaseException, overrides: Iterable[str] = ()) -> ConfigError:
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

    chain = []
    e: Optional[BaseException] = exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__

    for err in chain:
        unknown = isinstance(err, ConfigKeyError) or re.search(r"Key '\w+' (is )?not in", str(err))
        if unknown and getattr(err, "full_key", None):
            key = err.full_key
            parent = key.rsplit(".", 1)[0] if "." in key else ""
            section = getattr(err, "object_type", None)
            allowed = _section_keys(section) or _schema_keys(parent)
            if "." not in key and section is not None and section is not Config:
                key = list_entry_key(key, str(exc), overrides) or key
            return ConfigError(key, unknown_key_problem(key, section), allowed or None)
        if isinstance(err, ValidationError) and getattr(err, "full_key", None):
            return ConfigError(err.full_key, first_line(getattr(err, "msg", str(err)), "invalid value"))
        if isinstance(err, OmegaConfBaseException) and getattr(err, "full_key", None):
            return ConfigError(err.full_key, first_line(getattr(err, "msg", str(err)), "invalid value"))

    text = str(exc)
    if re.search(r"Error parsing override|LexerNoViableAlt|mismatched input|no viable alternative", text):
        return ConfigError("overrides", first_line(text, "invalid value"),
                           "key=value, +key=value, group=option; quote a value with special characters: key='a,b'")
    missing = re.search(r"Could not find '([\w/.-]+)/([\w.-]+)'", text)
    if missing:
        group, option = missing.group(1), missing.group(2)
        key = "+recipe" if group == "recipe" else group
        return ConfigError(key, f"no option '{option}'", available_options(group))
    missing_group = re.search(r"Could not override '([\w.]+)'.*?Key '(\w+)' is not in struct", text, re.S)
    if missing_group:
        key = missing_group.group(1)
        parent = key.rsplit(".", 1)[0] if "." in key else ""
        return ConfigError(key, "unknown key", _schema_keys(parent) or None)
    return ConfigError("overrides", first_line(text, "invalid value"))


def explain(exc: ConfigError) -> ConfigError:
    """A YAML syntax error in a config file: name the file and line instead of the parser's
    first words (the original error is the ConfigError's context)."""
    e: Optional[BaseException] = exc
    seen = []
    while e is not None and e not in seen:
        seen.append(e)
        mark = getattr(e, "problem_mark", None)
        if mark is not None and getattr(mark, "name", None):
            problem = getattr(e, "problem", None) or "invalid YAML"
            context = getattr(e, "context", None)
            return ConfigError(f"{mark.name}:{mark.line + 1}:{mark.column + 1}",
                               f"YAML error: {problem}" + (f" ({context})" if context else ""))
        e = e.__cause__ or e.__context__
    return exc


# --- the command ----------------------------------------------------------------------------------
