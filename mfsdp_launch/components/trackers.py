"""Optional experiment trackers: Weights & Biases and MLflow, fed the rows of metrics.jsonl.

    logging.wandb.enabled=true   (wandb.mode: offline by default; `wandb sync RUN/wandb` uploads)
    logging.mlflow.enabled=true  (mlflow.tracking_uri: default a file store in RUN/mlruns)

A run dir is one tracker run: its id is kept in `run.dir/trackers.json` with the last step sent,
so a resumed run re-attaches to the same W&B/MLflow run and sends only steps it has not sent (a
resume repeats the steps after its checkpoint bit for bit, so those rows are already there).
Only rank 0 opens trackers. A tracker that is asked for but not installed is a warning, not a
failure; so is a tracker that fails while logging (the run's own metrics.jsonl is the record).
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

from ..core import rundir
from ..core.atomic_io import atomic_write_text



def _warn(msg: str) -> None:
    print(f"mfsdp-train: warning: {msg}", file=sys.stderr, flush=True)


def settings(logging_cfg, name: str) -> dict:
    """`logging.<name>` as a plain dict, its defaults from the schema (core/schema.py). Also takes
    a plain mapping, where `{"wandb": True}` means enabled."""
    from omegaconf import OmegaConf

    from ..core.schema import LoggingConfig

    node = logging_cfg if logging_cfg is not None else {}
    if isinstance(node, dict):
        node = {k: ({"enabled": v} if isinstance(v, bool) else v) for k, v in node.items()}
    typed = OmegaConf.merge(OmegaConf.structured(LoggingConfig), node)
    return OmegaConf.to_container(typed[name], resolve=True, enum_to_str=True)


class _Ledger:
    """run.dir/trackers.json: per tracker, its run id and the last step it was sent."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / rundir.TRACKERS
        try:
            self.data: Dict[str, dict] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.data = {}

    def get(self, name: str) -> dict:
        return self.data.setdefault(name, {})

    def save(self) -> None:
        atomic_write_text(self.path, json.dumps(self.data, indent=1) + "\n")


def _numbers(row: dict) -> Dict[str, float]:
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class _Wandb:
    name = "wandb"

    def __init__(self, cfg: dict, run_dir: Path, state: dict, run_name: str, config: Optional[dict]):
        import wandb

        state.setdefault("run_id", uuid.uuid4().hex[:12])
        self.run = wandb.init(project=cfg["project"], entity=cfg["entity"], mode=cfg["mode"],
                              name=cfg["name"] or run_name, tags=cfg["tags"] or None,
                              dir=str(cfg["dir"] or run_dir), id=state["run_id"], resume="allow",
                              config=config, settings=wandb.Settings(silent=True, console="off"))

    def log(self, row: dict) -> None:
        self.run.log(_numbers(row), step=int(row["step"]))

    def close(self) -> None:
        self.run.finish()


CONNECT_TIMEOUT_S = 5.0  # a tracking server that does not answer in this long is not there
# MLflow's own HTTP defaults retry for minutes (7 retries, backoff factor 2, 120 s timeouts): a
# tracker must never hold training up that long, at the start or at any row.
MLFLOW_HTTP = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
               "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


class TrackerUnreachable(RuntimeError):
    pass


def check_reachable(uri: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
    """A TCP connection to an http(s) tracking server within `timeout`, else TrackerUnreachable."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(uri)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname or "localhost", port), timeout=timeout).close()
    except OSError as exc:
        raise TrackerUnreachable(f"the tracking server {uri} did not answer within {timeout:g} s "
                                 f"({exc.strerror or type(exc).__name__})") from None


class _Mlflow:
    name = "mlflow"

    def __init__(self, cfg: dict, run_dir: Path, state: dict, run_name: str, config: Optional[dict]):
        uri = cfg["tracking_uri"] or (Path(run_dir) / "mlruns").as_uri()
        if uri.startswith("file:"):
            # MLflow 3 keeps its file store in maintenance mode behind this switch: it needs no server.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        elif uri.startswith(("http://", "https://")):
            for k, v in MLFLOW_HTTP.items():
                os.environ.setdefault(k, v)
            check_reachable(uri)
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        run_id = state.get("run_id")
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
        else:
            exp = self.client.get_experiment_by_name(cfg["experiment"])
            exp_id = exp.experiment_id if exp else self.client.create_experiment(cfg["experiment"])
            run = self.client.create_run(exp_id, run_name=cfg["run_name"] or run_name)
            run_id = run.info.run_id
            state["run_id"] = run_id
            if config:
                self._log_params(run_id, config)
        state["tracking_uri"] = uri
        self.run_id = run_id

    def _log_params(self, run_id: str, config: dict) -> None:
        from mlflow.entities import Param

        flat = _flatten(config)
        params = [Param(k, str(v)[:500]) for k, v in flat.items()]
        for i in range(0, len(params), 100):  # MLflow's batch limit
            self.client.log_batch(run_id, params=params[i:i + 100])

    def log(self, row: dict) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        step = int(row["step"])
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in _numbers(row).items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(d: Any, prefix: str = "") -> Dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: Dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}." if isinstance(v, dict) else f"{prefix}{k}"))
    return {k.rstrip("."): v for k, v in out.items()}


class Trackers:
    """`log(row)` for every metrics row, `close()` at the end. Steps at or below a tracker's last
    sent step are not sent again."""

    def __init__(self, run_dir: Path, opened: List[Any], ledger: _Ledger):
        self.run_dir, self.opened, self.ledger = Path(run_dir), opened, ledger

    def __bool__(self) -> bool:
        return bool(self.opened)

    def log(self, row: dict) -> None:
        step = int(row["step"])
        sent = False
        for t in list(self.opened):
            state = self.ledger.get(t.name)
            if step <= state.get("last_step", -1):
                continue
            try:
                t.log(row)
            except Exception as exc:  # noqa: BLE001 - the run goes on; metrics.jsonl has the rows
                _warn(f"{t.name}: logging failed, turning it off for this run: {type(exc).__name__}: {exc}")
                self.opened.remove(t)
                continue
            state["last_step"] = step
            sent = True
        if sent:
            self.ledger.save()

    def close(self) -> None:
        for t in self.opened:
            try:
                t.close()
            except Exception as exc:  # noqa: BLE001
                _warn(f"{t.name}: closing failed: {type(exc).__name__}: {exc}")
        self.opened = []
        self.ledger.save()


def open_trackers(logging_cfg, run_dir, resumed_step: int = 0, run_name: Optional[str] = None) -> Trackers:
    """The trackers `logging_cfg` asks for, attached to this run dir's tracker runs (created on
    the first call). `resumed_step`: the step the run continues from (rows above it follow)."""
    run_dir = Path(run_dir)
    ledger = _Ledger(run_dir)
    config = _frozen_config(run_dir)
    run_name = run_name or ((config or {}).get("run") or {}).get("name") or run_dir.name
    opened = []
    for cls, package in ((_Wandb, "wandb"), (_Mlflow, "mlflow")):
        cfg = settings(logging_cfg, cls.name)
        if not cfg["enabled"]:
            continue
        state = ledger.get(cls.name)
        if resumed_step == 0 and state.get("last_step", 0) > 0:
            state.clear()  # starting over in a used run dir (resume=never): a new tracker run
        try:
            __import__(package)
        except ImportError:
            _warn(f"logging.{cls.name}.enabled=true but {package} is not installed "
                  f"(pip install 'mfsdp-launch[{cls.name}]'); going on without it")
            continue
        try:
            opened.append(cls(cfg, run_dir, state, run_name, config))
        except Exception as exc:  # noqa: BLE001 - a tracker must not stop training
            _warn(f"{cls.name}: could not start: {type(exc).__name__}: {exc}; going on without it")
            continue
        state.setdefault("last_step", int(resumed_step))
    if opened:
        ledger.save()
    return Trackers(run_dir, opened, ledger)


def _frozen_config(run_dir: Path) -> Optional[dict]:
    try:
        import yaml

        data = yaml.safe_load((Path(run_dir) / rundir.CONFIG).read_text())
    except Exception:  # noqa: BLE001 - the config is a nicety for the tracker
        return None
    return data if isinstance(data, dict) else None
