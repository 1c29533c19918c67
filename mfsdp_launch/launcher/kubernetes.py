"""`launcher=kubernetes`: write a PyTorchJob (Kubeflow training operator, kubeflow.org/v1) or, with
`launcher.kind=jobset`, a JobSet (jobset.x-k8s.io/v1alpha2) manifest into run.dir, and apply it
with `kubectl apply -f` when `launcher.submit=true`. No cluster is needed to write it.

One pod per node (launcher.nnodes), each running the node command the sbatch script runs
(jobscript.py): torchrun for the node's launcher.nproc_per_node ranks, its static rendezvous from
the job's environment (MASTER_ADDR, MASTER_PORT and PET_NODE_RANK: the training operator
sets them in every pod of a PyTorchJob; the JobSet sets the same from its pod index). The frozen
config is a ConfigMap mounted read-only in every pod; the run dir is the volume claim
`launcher.pvc` (sub-directory run.name) at `launcher.pvc_mount`, so a restarted job resumes.

SIGTERM to a pod (a preemption, a drain, `kubectl delete`): its script touches the STOP file on
the shared run dir, every rank saves and stops; an interrupted run exits 143, which the job
retries (PyTorchJob restartPolicy ExitCode, JobSet failurePolicy) up to launcher.backoff_limit
times: the new pods resume from that checkpoint.
"""

from __future__ import annotations

import copy
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import List

import yaml
from omegaconf import OmegaConf

from ..core import exit_codes, k8s, rundir
from ..core.atomic_io import atomic_write_text
from ..core.console import eprint
from ..core.schema import LauncherKind
from . import jobscript
from .slurm import gpus_per_node

API = {LauncherKind.pytorchjob: ("kubeflow.org/v1", "PyTorchJob"),
       LauncherKind.jobset: ("jobset.x-k8s.io/v1alpha2", "JobSet")}
CONTAINER = "pytorch"  # the training operator looks for its port on the container of this name
PORT_NAME, PORT = "pytorchjob-port", 23456  # the operator's defaults
CONFIG_MOUNT = "/etc/mfsdp"
PYTHON = "python3"  # the image's interpreter, with this package installed
RETRY_EXIT = 143  # 128 + SIGTERM: retryable under restartPolicy ExitCode (1-127 are permanent)
REPLICATED_JOB = "node"  # the JobSet's one replicated job: pods <name>-node-<i>-0
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def pod_script(cfg) -> str:
    """The bash script each pod runs (its container's command)."""
    lc = cfg.launcher
    config = f'"$RUN_DIR/{rundir.CONFIG}"'
    cpus = str(lc.cpus_per_node) if lc.cpus_per_node else "$(nproc)"
    rendezvous = ['--node-rank="$NODE_RANK"', '--master-addr="$MASTER_ADDR"', '--master-port="$MASTER_PORT"']
    torchrun = jobscript.node_torchrun(lc, python=PYTHON, nnodes=str(lc.nnodes), rendezvous=rendezvous,
                                       config=config)
    lines = [
        f"# Written by mfsdp-train for run {cfg.run.name!r}: one pod per node, on the run dir's volume claim.",
        "set -uo pipefail  # not -e: the training step's exit code is judged below",
        *jobscript.environment(lc.pvc_mount, lc.nproc_per_node, cpus),
        "# This pod's node rank: the training operator sets PET_NODE_RANK (older ones only RANK).",
        'NODE_RANK="${PET_NODE_RANK:-${RANK:-0}}"',
        f'mkdir -p "$RUN_DIR/{rundir.LOGS}" || exit {exit_codes.FAILED}',
        "# The frozen config (the ConfigMap) into the run dir, where the ranks and the summary read it.",
        f'cp "$MFSDP_CONFIG" "$RUN_DIR/{rundir.CONFIG}.tmp.$HOSTNAME" && '
        f'mv -f "$RUN_DIR/{rundir.CONFIG}.tmp.$HOSTNAME" {config} || exit {exit_codes.FAILED}',
        'if [ "$NODE_RANK" = 0 ]; then',
        *["  " + ln for ln in jobscript.lock("pod $HOSTNAME")],
        f'  rm -f "$RUN_DIR/{rundir.STOP}"',
        "fi",
        *jobscript.stop_traps(["TERM"]),
        "START=$SECONDS",
        "# This pod's torchrun; in the background, so that the SIGTERM trap runs while it trains.",
        " \\\n  ".join(torchrun) + " &",
        *jobscript.wait_and_judge(PYTHON, "TORCHRUN_PID", config),
        "# Interrupted (some pod got SIGTERM; a checkpoint is saved): a retryable exit, the job resumes.",
        f'if [ "$CODE" -eq {exit_codes.INTERRUPTED} ]; then exit {RETRY_EXIT}; fi',
        'exit "$CODE"',
    ]
    return "\n".join(lines) + "\n"


def pod_config(cfg) -> str:
    """The frozen config as the pods see it: run.dir is the volume claim's mount."""
    pod = copy.deepcopy(cfg)
    pod.run.dir = cfg.launcher.pvc_mount
    return OmegaConf.to_yaml(pod, resolve=True)


def _resources(cfg) -> dict:
    lc, limits = cfg.launcher, {}
    gpus = gpus_per_node(cfg)
    if gpus:
        limits["nvidia.com/gpu"] = int(gpus)
    if lc.cpus_per_node:
        limits["cpu"] = int(lc.cpus_per_node)
    if lc.memory_per_node:
        limits["memory"] = str(lc.memory_per_node)
    return {"limits": limits, "requests": dict(limits)} if limits else {}


def pod_template(cfg, name: str, env: List[dict]) -> dict:
    lc = cfg.launcher
    container = {
        "name": CONTAINER, "image": lc.image, "command": ["bash", "-c", pod_script(cfg)],
        "env": [{"name": "MFSDP_CONFIG", "value": f"{CONFIG_MOUNT}/{rundir.CONFIG}"}, *env],
        "ports": [{"name": PORT_NAME, "containerPort": PORT}],
        "volumeMounts": [{"name": "run", "mountPath": lc.pvc_mount, "subPath": name},
                         {"name": "config", "mountPath": CONFIG_MOUNT, "readOnly": True},
                         {"name": "dshm", "mountPath": "/dev/shm"}],  # NCCL and data workers need more than 64 MB
    }
    resources = _resources(cfg)
    if resources:
        container["resources"] = resources
    return {
        "metadata": {"labels": _labels(name)},
        "spec": {
            "terminationGracePeriodSeconds": int(lc.termination_grace_s),
            "containers": [container],
            "volumes": [{"name": "run", "persistentVolumeClaim": {"claimName": lc.pvc}},
                        {"name": "config", "configMap": {"name": f"{name}-config"}},
                        {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
        },
    }


def _labels(name: str) -> dict:
    return {"app.kubernetes.io/managed-by": "mfsdp-launch", "mfsdp-launch/run": name}


def _metadata(cfg, name: str, run: str) -> dict:
    meta = {"name": name, "labels": _labels(run)}
    if cfg.launcher.namespace:
        meta["namespace"] = cfg.launcher.namespace
    return meta


def pytorchjob(cfg, name: str) -> dict:
    lc = cfg.launcher
    api, kind = API[LauncherKind.pytorchjob]
    # restartPolicy ExitCode: 1-127 (a config error, a crash) fail the job; 128-255 are retried.
    replica = {"restartPolicy": "ExitCode", "template": pod_template(cfg, name, [])}
    specs = {"Master": {"replicas": 1, **replica}}
    if lc.nnodes > 1:
        specs["Worker"] = {"replicas": lc.nnodes - 1, **copy.deepcopy(replica)}
    return {"apiVersion": api, "kind": kind, "metadata": _metadata(cfg, name, name),
            "spec": {"nprocPerNode": str(lc.nproc_per_node),
                     "runPolicy": {"backoffLimit": int(lc.backoff_limit), "cleanPodPolicy": "None"},
                     "pytorchReplicaSpecs": specs}}


def jobset(cfg, name: str) -> dict:
    """One replicated job of nnodes indexed pods; the environment the training operator would set."""
    lc = cfg.launcher
    api, kind = API[LauncherKind.jobset]
    index = {"valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}}
    env = [{"name": "MASTER_ADDR", "value": f"{name}-{REPLICATED_JOB}-0-0.{name}"},
           {"name": "MASTER_PORT", "value": str(PORT)},
           {"name": "WORLD_SIZE", "value": str(lc.nnodes * lc.nproc_per_node)},
           {"name": "RANK", **index}, {"name": "PET_NODE_RANK", **index},
           {"name": "PET_NNODES", "value": str(lc.nnodes)},
           {"name": "PET_NPROC_PER_NODE", "value": str(lc.nproc_per_node)}]
    template = pod_template(cfg, name, env)
    template["spec"]["restartPolicy"] = "Never"  # a failed pod fails its Job: the JobSet restarts them all
    job = {"parallelism": lc.nnodes, "completions": lc.nnodes, "completionMode": "Indexed", "backoffLimit": 0,
           "template": template}
    return {"apiVersion": api, "kind": kind, "metadata": _metadata(cfg, name, name),
            "spec": {"failurePolicy": {"maxRestarts": int(lc.backoff_limit)},
                     "network": {"enableDNSHostnames": True, "subdomain": name},
                     "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": {"spec": job}}]}}


def manifest(cfg) -> List[dict]:
    """[ConfigMap, PyTorchJob or JobSet]: what `kubectl apply -f` creates."""
    name = k8s.resource_name(cfg.run.name)
    config_map = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _metadata(cfg, f"{name}-config", name),
                  "data": {rundir.CONFIG: pod_config(cfg)}}
    job = jobset(cfg, name) if cfg.launcher.kind == LauncherKind.jobset else pytorchjob(cfg, name)
    return [config_map, job]


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the script, the config) as literal blocks: readable in the file."""


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s,
                                                             style="|" if "\n" in s else None))


def manifest_text(cfg) -> str:
    head = (f"# Written by mfsdp-train for run {cfg.run.name!r}: the frozen config (ConfigMap) and the "
            f"{API[cfg.launcher.kind][1]}.\n# Apply it with: kubectl apply -f {rundir.KUBERNETES_MANIFEST}\n")
    return head + yaml.dump_all(manifest(cfg), Dumper=_Dumper, sort_keys=False, width=120)


def write_and_maybe_submit(cfg, config_path: Path) -> int:
    """Write `run.dir/kubernetes.yaml`; apply it if launcher.submit=true. 0 on success, 2 when kubectl
    is needed but missing, kubectl's exit code if it refused."""
    run_dir = Path(config_path).resolve().parent
    path = run_dir / rundir.KUBERNETES_MANIFEST
    atomic_write_text(path, manifest_text(cfg))
    lc = cfg.launcher
    name, kind = k8s.resource_name(cfg.run.name), API[lc.kind][1]
    print(f"mfsdp-train: wrote {path} ({kind} {name}: {lc.nnodes} pod(s) x {lc.nproc_per_node} processes)",
          flush=True)
    if not lc.submit:
        print(f"mfsdp-train: apply it with: kubectl apply -f {shlex.quote(str(path))}   (or add launcher.submit=true)",
              flush=True)
        return exit_codes.OK
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        eprint(f"mfsdp-train: error: launcher.submit: kubectl not found on PATH; run `kubectl apply -f {path}` "
               "where kubectl reaches the cluster (allowed: false)")
        return exit_codes.CONFIG
    proc = subprocess.run([kubectl, "apply", "-f", str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        eprint(f"mfsdp-train: error: kubectl apply refused the job (exit code {proc.returncode}): "
               f"{msg[-1] if msg else 'no message'}")
        return proc.returncode
    first_pod = f"{name}-master-0" if lc.kind == LauncherKind.pytorchjob else f"{name}-{REPLICATED_JOB}-0-0"
    print(f"mfsdp-train: applied {path} ({proc.stdout.strip().replace(chr(10), '; ')}); "
          f"follow it with: kubectl logs -f {first_pod}", flush=True)
    return exit_codes.OK
