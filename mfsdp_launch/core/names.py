"""Names to objects, and exceptions to one line: the helpers every one-line refusal uses.

`import_object` is the one import-by-name rule (`model.target`, `model.fsdp_unit_modules`, the
engines table, the probes): `pkg.module:attr.path`, or `pkg.module.attr` with the longest importable
module prefix; every failure is one ConfigError line naming the key.
"""

from __future__ import annotations

import importlib
from typing import Any, Sequence

from .errors import ConfigError


def first_line(value: Any, default: str = "") -> str:
    """The first line of a text or an exception's message, stripped; `default` when it is empty."""
    text = str(value).strip()
    return text.splitlines()[0] if text else default


def exception_line(exc: BaseException) -> str:
    """`Type: first line of the message`, as a refusal quotes a failure."""
    return f"{type(exc).__name__}: {first_line(exc)}".rstrip(": ")


def import_object(spec: str, *, key: str) -> Any:
    """`pkg.module:attr.path` or `pkg.module.attr` -> the object; one ConfigError line otherwise."""
    spec = str(spec).strip()
    if ":" in spec:
        module_name, _, attrs = spec.partition(":")
        if not module_name or not attrs or ":" in attrs:
            raise ConfigError(key, f"{spec!r} is not of the form pkg.module:function")
        return _getattrs(_import(module_name, spec, key), module_name, attrs.split("."), key)
    parts = spec.split(".")
    if len(parts) < 2 or not all(parts):
        raise ConfigError(key, f"{spec!r} is not of the form pkg.module:function or pkg.module.function")
    for cut in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
        module_name = ".".join(parts[:cut])
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if not _on_path(module_name, exc):  # the module imports something missing
                raise ConfigError(key, f"importing {module_name!r} failed ({exception_line(exc)})") from exc
            continue
        except Exception as exc:  # noqa: BLE001 - the user's module raised while importing
            raise ConfigError(key, f"importing {module_name!r} failed ({exception_line(exc)})") from exc
        return _getattrs(module, module_name, parts[cut:], key)
    raise ConfigError(key, f"cannot import {spec!r}: no module named {parts[0]!r} "
                           "(is its directory on PYTHONPATH?)")


def _import(module_name: str, spec: str, key: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if _on_path(module_name, exc):
            raise ConfigError(key, f"cannot import {spec!r}: no module named {exc.name!r} "
                                   "(is its directory on PYTHONPATH?)") from exc
        raise ConfigError(key, f"importing {module_name!r} failed ({exception_line(exc)})") from exc
    except Exception as exc:  # noqa: BLE001 - the user's module raised while importing
        raise ConfigError(key, f"importing {module_name!r} failed ({exception_line(exc)})") from exc


def _on_path(module_name: str, exc: ModuleNotFoundError) -> bool:
    """Whether the missing module is `module_name` or one of its parent packages."""
    return exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + "."))


def _getattrs(obj: Any, module_name: str, attrs: Sequence[str], key: str) -> Any:
    for i, attr in enumerate(attrs):
        if not hasattr(obj, attr):
            owner = ".".join([module_name, *attrs[:i]])
            raise ConfigError(key, f"{owner!r} has no attribute {attr!r}")
        obj = getattr(obj, attr)
    return obj
