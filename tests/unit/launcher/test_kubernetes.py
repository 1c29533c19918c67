"""launcher=kubernetes: the PyTorchJob/JobSet manifest checked against the resources' schemas
(tests/data/k8s, derived from the published CRDs), kubectl submission, and the pod's own command
run here as the training operator would start it in a one-pod job (no cluster needed)."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

jsonschema = pytest.importorskip("jsonschema")  # the GPU machine has none

from helpers import ROOT, cli, cli_env, free_port, read_metrics, refused
from mfsdp_launch.launcher import kubernetes
from mfsdp_launch.planner import prepare

SCHEMAS = ROOT / "tests" / "data" / "k8s"
K8S = ("launcher=kubernetes", "launcher.image=ghcr.io/me/train:1", "launcher.pvc=shared-runs")


def schema(name: str):
    return jsonschema.Draft202012Validator(json.loads((SCHEMAS / f"{name}.schema.json").read_text()))


def manifest_of(*overrides: str, run_dir="/tmp/unused"):
    cfg, _ = prepare(["+recipe=cpu_smoke", *K8S, f"run.dir={run_dir}", *overrides], check_hardware=False)
    return cfg, kubernetes.manifest(cfg)


def containers(job: dict) -> list:
    if job["kind"] == "PyTorchJob":
        return [s["template"]["spec"]["containers"][0] for s in job["spec"]["pytorchReplicaSpecs"].values()]
    return [j["template"]["spec"]["template"]["spec"]["containers"][0] for j in job["spec"]["replicatedJobs"]]


@pytest.mark.parametrize("kind,nnodes", [("pytorchjob", 1), ("pytorchjob", 4), ("jobset", 4)])
def test_manifest_validates_against_the_published_schemas(kind, nnodes):
    cfg, (config_map, job) = manifest_of(f"launcher.kind={kind}", f"launcher.nnodes={nnodes}", "mesh.dp_outer=nodes",
                                         "launcher.namespace=ml", "launcher.cpus_per_node=32",
                                         "launcher.memory_per_node=500Gi", "launcher.gpus_per_node=2",
                                         "launcher.termination_grace_s=600", "run.name=My_Run")
    schema("configmap").validate(config_map)
    schema(kind).validate(job)
    assert job["metadata"] == {"name": "my-run", "namespace": "ml", "labels": {
        "app.kubernetes.io/managed-by": "mfsdp-launch", "mfsdp-launch/run": "my-run"}}
    pod_cfg = yaml.safe_load(config_map["data"]["config.yaml"])
    assert pod_cfg["run"]["dir"] == "/mnt/run" and pod_cfg["launcher"]["nnodes"] == nnodes
    if kind == "pytorchjob":
        specs = job["spec"]["pytorchReplicaSpecs"]
        assert specs["Master"]["replicas"] == 1 and specs.get("Worker", {"replicas": 0})["replicas"] == nnodes - 1
        assert job["spec"]["nprocPerNode"] == "2"
    else:
        rj = job["spec"]["replicatedJobs"][0]["template"]["spec"]
        assert rj["parallelism"] == rj["completions"] == nnodes and rj["completionMode"] == "Indexed"
        env = {e["name"]: e.get("value", e.get("valueFrom")) for e in containers(job)[0]["env"]}
        assert env["MASTER_ADDR"] == "my-run-node-0-0.my-run" and env["PET_NNODES"] == str(nnodes)
    for c in containers(job):  # every pod: the same command, one torchrun for the node's 2 ranks
        assert c["command"] == containers(job)[0]["command"]
        assert c["resources"]["limits"] == {"nvidia.com/gpu": 2, "cpu": 32, "memory": "500Gi"}
        assert {"name": "run", "mountPath": "/mnt/run", "subPath": "my-run"} in c["volumeMounts"]
    script = containers(job)[0]["command"][2]
    assert f"--nnodes={nnodes}" in script and "--nproc-per-node=2" in script
    assert "trap 'stop_request TERM' TERM" in script
    pod = (job["spec"]["pytorchReplicaSpecs"]["Master"]["template"] if kind == "pytorchjob"
           else job["spec"]["replicatedJobs"][0]["template"]["spec"]["template"])
    assert pod["spec"]["terminationGracePeriodSeconds"] == 600


def test_the_schemas_refuse_what_a_cluster_would_not_run():
    _, (config_map, job) = manifest_of()
    validator = schema("pytorchjob")
    for mutate in (lambda j: j["spec"]["pytorchReplicaSpecs"]["Master"].update(restartPolicy="Sometimes"),
                   lambda j: j["spec"].update(nprocPerNode=2),  # a string in the CRD
                   lambda j: j["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"].update(
                       terminationGracePeriod=30),  # misspelt: the API server would drop it
                   lambda j: j["metadata"].update(name="cpu_smoke")):
        bad = copy.deepcopy(job)
        mutate(bad)
        assert not validator.is_valid(bad)
    bad = copy.deepcopy(config_map)
    bad["data"]["n"] = 3
    assert not schema("configmap").is_valid(bad)


def test_refusals_are_one_line():
    assert refused("+recipe=cpu_smoke", "launcher=kubernetes", "launcher.pvc=p").key == "launcher.image"
    assert refused("+recipe=cpu_smoke", "launcher=kubernetes", "launcher.image=i").key == "launcher.pvc"
    assert refused(*K8S, "launcher.rdzv_endpoint=h:1").key == "launcher.rdzv_endpoint"
    assert refused(*K8S, "launcher.memory_per_node=lots").key == "launcher.memory_per_node"
    assert refused(*K8S, "launcher.nproc_per_node=auto").key == "launcher.nproc_per_node"
    assert refused(*K8S, "run.name=_").key == "run.name"
    assert refused(*K8S, "launcher.kind=nope").key == "launcher.kind"


def test_cli_writes_the_manifest_and_submit_needs_kubectl(tmp_path):
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir()
    run_dir = tmp_path / "run"
    r = cli("+recipe=cpu_smoke", *K8S, f"run.dir={run_dir}", "launcher.submit=true", cwd=tmp_path, timeout=120,
            env={"PATH": str(empty_bin)})
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1, r.stdout + r.stderr
    assert err[0].startswith("mfsdp-train: error: launcher.submit: kubectl not found on PATH")
    docs = list(yaml.safe_load_all((run_dir / "kubernetes.yaml").read_text()))  # written anyway
    assert [d["kind"] for d in docs] == ["ConfigMap", "PyTorchJob"]
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "kubectl").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/kubectl_args\n"
                                  "echo 'configmap/cpu-smoke-config created'\necho 'pytorchjob.kubeflow.org/cpu-smoke created'\n")
    (fake / "kubectl").chmod(0o755)
    r = cli("+recipe=cpu_smoke", *K8S, f"run.dir={run_dir}", "launcher.submit=true", "launcher.kind=jobset",
            cwd=tmp_path, timeout=120, env={"PATH": f"{fake}{os.pathsep}{os.environ.get('PATH', '')}"})
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "kubectl_args").read_text().split() == ["apply", "-f", str(run_dir / "kubernetes.yaml")]
    assert "kubectl logs -f cpu-smoke-node-0-0" in r.stdout
    assert [d["kind"] for d in yaml.safe_load_all((run_dir / "kubernetes.yaml").read_text())] == ["ConfigMap", "JobSet"]


def operator_env(nproc: int, port: int) -> dict:
    """What the training operator sets in the one pod (the master) of a one-node PyTorchJob."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PET_MASTER_ADDR": "127.0.0.1",
            "PET_MASTER_PORT": str(port), "WORLD_SIZE": str(nproc), "RANK": "0", "PET_NPROC_PER_NODE": str(nproc),
            "PET_NODE_RANK": "0", "PET_NNODES": "1", "PYTHONUNBUFFERED": "0"}


@pytest.mark.slow
def test_the_pod_command_trains_and_stops_on_sigterm_for_the_job_to_retry(tmp_path):
    """The container's command and environment from the manifest, run as the operator starts it
    (the ConfigMap's file where the volume mount puts it, python3 being this interpreter): a STOP
    file an earlier attempt left is cleared, it trains, and SIGTERM (a preemption) saves a
    checkpoint and exits 143, which the job retries (the retry resumes as any re-run does)."""
    pvc = tmp_path / "pvc"
    pvc.mkdir()
    (pvc / "STOP").touch()  # left by the attempt a preemption stopped: not a stop request of this one
    # One rank in the pod: what is proven is the pod's command and its signal and exit code; every
    # rank stopping together on SIGTERM is test_run_lifecycle's (2 ranks).
    small = ["model.preset=tiny", "train.seq_len=64", "data.max_bytes=2000000", "train.log_interval=1",
             "train.grad_accum_steps=1", "train.micro_batch_size=2", "train.progress=false", "engine.backend=gloo",
             "launcher.nproc_per_node=1"]
    _, (config_map, job) = manifest_of(f"launcher.pvc_mount={pvc}", "train.steps=400", *small,
                                       run_dir=tmp_path / "local")
    assert "--nproc-per-node=1" in containers(job)[0]["command"][2]
    container = containers(job)[0]
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "config.yaml").write_text(config_map["data"]["config.yaml"])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    env = {**cli_env(), **{e["name"]: e["value"] for e in container["env"]}, **operator_env(1, free_port()),
           "MFSDP_CONFIG": str(etc / "config.yaml"), "HOSTNAME": "cpu-smoke-master-0",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    log = open(tmp_path / "pod.out", "w")
    pod = subprocess.Popen(container["command"], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while len(read_metrics(pvc)) < 2:
            assert pod.poll() is None, (tmp_path / "pod.out").read_text()[-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert json.loads((pvc / "run.lock").read_text())["command"] == "pod cpu-smoke-master-0"
        pod.send_signal(signal.SIGTERM)  # the kubelet: to the container's first process
        pod.wait(timeout=120)
    finally:
        if pod.poll() is None:
            pod.kill()
        log.close()
    out = (tmp_path / "pod.out").read_text()
    assert pod.returncode == kubernetes.RETRY_EXIT, out[-3000:]
    stopped = read_metrics(pvc)[-1]["step"]
    assert stopped >= 2 and (pvc / "checkpoints" / f"step_{stopped}" / "manifest.json").is_file()
    assert f"interrupted at step {stopped}/400" in out and "epochs of the data" in out and "Traceback" not in out
    assert (pvc / "config.yaml").read_text() == config_map["data"]["config.yaml"] and not (pvc / "run.lock").exists()
