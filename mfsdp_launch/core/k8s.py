"""Kubernetes names and the checks on the `launcher.*` keys a PyTorchJob/JobSet manifest uses.
Standard library only: the planner's validation and the launcher's manifest writer share it."""

from __future__ import annotations

import re
from typing import Optional

from .errors import ConfigError, check_at_least

# A JobSet's pod hostnames are <name>-<replicated job>-<job index>-<pod index>: at most 63
# characters in all, so the name itself stays well below that.
NAME_MAX = 40
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# Kubernetes' resource.Quantity: a number with an optional binary/decimal suffix.
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|m)?$")


def resource_name(run_name: str) -> str:
    """run.name as a Kubernetes object name (a DNS-1123 label): lower case, `_` and other
    characters become `-`, cut to NAME_MAX. ConfigError when nothing usable is left."""
    name = re.sub(r"[^a-z0-9-]+", "-", str(run_name).lower()).strip("-")[:NAME_MAX].strip("-")
    if not name or not name[0].isalpha():
        raise ConfigError("run.name", f"{run_name!r} gives no Kubernetes object name (a DNS label "
                          "starting with a letter)", "letters, digits, '-' and '_', starting with a letter")
    return name


def check(lc) -> None:
    """The kubernetes keys of a launcher section whose kind is pytorchjob or jobset."""
    if not (lc.image or "").strip():
        raise ConfigError("launcher.image", "is not set: every pod runs this container image",
                          "an image with this package and torch installed, e.g. launcher.image=ghcr.io/me/train:1")
    if not (lc.pvc or "").strip():
        raise ConfigError("launcher.pvc", "is not set: the run dir (checkpoints, metrics, logs) lives on a "
                          "volume claim every pod mounts", "the name of a ReadWriteMany PersistentVolumeClaim")
    _label("launcher.pvc", lc.pvc, subdomain=True)
    if lc.namespace is not None:
        _label("launcher.namespace", lc.namespace)
    if not str(lc.pvc_mount).startswith("/"):
        raise ConfigError("launcher.pvc_mount", f"{lc.pvc_mount!r} is not an absolute path", "e.g. /mnt/run")
    if lc.rdzv_endpoint or lc.rdzv_id:
        key = "launcher.rdzv_endpoint" if lc.rdzv_endpoint else "launcher.rdzv_id"
        raise ConfigError(key, f"not used with launcher.kind={lc.kind}: the job gives every pod its "
                          "rendezvous (MASTER_ADDR, MASTER_PORT)", "null")
    if lc.cpus_per_node is not None and lc.cpus_per_node < 1:
        raise ConfigError("launcher.cpus_per_node", f"must be >= 1, got {lc.cpus_per_node}", "a positive integer, or null")
    if lc.memory_per_node is not None and not _QUANTITY.match(str(lc.memory_per_node)):
        raise ConfigError("launcher.memory_per_node", f"{lc.memory_per_node!r} is not a Kubernetes quantity",
                          "e.g. 64Gi, 1500Gi, or null")
    check_at_least(lc, "launcher", ("termination_grace_s", "backoff_limit"), 0)


def _label(key: str, value: Optional[str], subdomain: bool = False) -> None:
    parts = str(value).split(".") if subdomain else [str(value)]
    if len(str(value)) > (253 if subdomain else 63) or not all(_DNS_LABEL.match(p) for p in parts):
        raise ConfigError(key, f"{value!r} is not a Kubernetes name", "lower-case letters, digits and '-'")
