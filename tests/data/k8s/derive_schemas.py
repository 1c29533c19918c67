"""How the JSON schemas beside this file were derived (run by hand, not by the tests; it needs the
published CRDs, which CI does not download):

    python3 tests/data/k8s/derive_schemas.py PYTORCHJOB_CRD.yaml JOBSET_CRD.yaml

* pytorchjob.schema.json: the openAPIV3Schema of version v1 in kubeflow/training-operator v1.9.0
  (commit 6f74c7f6b2ed6c27aabd82d0a316b23f0646059c), manifests/base/crds/kubeflow.org_pytorchjobs.yaml.
* jobset.schema.json: the openAPIV3Schema of version v1alpha2 in kubernetes-sigs/jobset v0.9.1
  (commit acea4e18c8d01b55023d74946237790105625ed4), config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml.
* configmap.schema.json and OBJECT_META (every object's metadata, which a CRD leaves as a plain
  object) are written by hand from the Kubernetes API's io.k8s.api.core.v1.ConfigMap
  and io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta (kubernetes/kubernetes
  api/openapi-spec/v3/api__v1_openapi.json), with the API server's name rules (DNS-1123).

Minimal: along the paths the manifests written by launcher/kubernetes.py use (every option on),
each object keeps its published types, required lists, enums, patterns and int-or-string
alternatives; a published field the manifests do not use keeps only its type. Every object on
those paths gets additionalProperties: false: the API server would silently prune a misspelt
field, so the test refuses it. Enums the CRD states only in a field's description (restartPolicy,
cleanPodPolicy; the operator's webhook enforces them) are added as enums. Descriptions dropped.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
KEEP = ("type", "required", "enum", "format", "pattern", "maxLength", "minLength", "minimum", "maximum",
        "maxItems", "minItems")
DESCRIBED_ENUMS = {"restartPolicy": {"pytorchjob": ["Always", "OnFailure", "Never", "ExitCode"]},
                   "cleanPodPolicy": {"pytorchjob": ["All", "Running", "None"]}}


_DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_META_FIELDS = ("annotations", "creationTimestamp", "deletionGracePeriodSeconds", "deletionTimestamp", "finalizers",
                "generateName", "generation", "managedFields", "ownerReferences", "resourceVersion", "selfLink", "uid")
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
OBJECT_META = {
    "type": "object", "required": ["name"], "additionalProperties": False,
    "properties": {"name": {"type": "string", "maxLength": 253, "pattern": _DNS1123_SUBDOMAIN},
                   "namespace": {"type": "string", "maxLength": 63, "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                   "labels": _STRING_MAP, "annotations": _STRING_MAP, **{f: {} for f in _META_FIELDS}},
}
CONFIG_MAP = {
    "type": "object", "required": ["apiVersion", "kind", "metadata"], "additionalProperties": False,
    "properties": {"apiVersion": {"enum": ["v1"]}, "kind": {"enum": ["ConfigMap"]}, "metadata": OBJECT_META,
                   "data": _STRING_MAP, "binaryData": {"type": "object", "additionalProperties":
                                                       {"type": "string", "contentEncoding": "base64"}},
                   "immutable": {"type": "boolean"}},
}


def usage(docs):
    """The union of the keys the given objects use, as a nested dict (lists and maps merged)."""
    def merge(into, value):
        if isinstance(value, dict):
            into = into if isinstance(into, dict) else {}
            for k, v in value.items():
                into[k] = merge(into.get(k), v)
            return into
        if isinstance(value, list):
            out = into if isinstance(into, dict) else {}
            for v in value:
                out = merge(out, {"[]": v})
            return out
        return into if into is not None else True
    tree = None
    for d in docs:
        tree = merge(tree, d)
    return tree


def prune(schema: dict, used, kind: str, name: str = "") -> dict:
    out = {k: schema[k] for k in KEEP if k in schema}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if name in DESCRIBED_ENUMS and kind in DESCRIBED_ENUMS[name]:
        out["enum"] = DESCRIBED_ENUMS[name][kind]
    if not isinstance(used, dict):
        return out
    if "properties" in schema:
        props = {}
        for k, sub in schema["properties"].items():
            props[k] = prune(sub, used.get(k), kind, k) if k in used else \
                {t: sub[t] for t in ("type",) if t in sub}
        out["properties"] = props
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if "items" in schema:
        out["items"] = prune(schema["items"], used.get("[]"), kind)
    if isinstance(schema.get("additionalProperties"), dict):
        values = usage([v for v in used.values()]) if "properties" not in schema else None
        out["additionalProperties"] = prune(schema["additionalProperties"], values, kind)
    return out


def samples():
    sys.path.insert(0, str(HERE.parents[2]))
    from mfsdp_launch.launcher.kubernetes import manifest
    from mfsdp_launch.planner import prepare

    out = {}
    for kind in ("pytorchjob", "jobset"):
        cfg, _ = prepare(["+recipe=cpu_smoke", "launcher=kubernetes", f"launcher.kind={kind}", "launcher.nnodes=2",
                          "launcher.image=i", "launcher.pvc=p", "launcher.namespace=n", "launcher.cpus_per_node=8",
                          "launcher.memory_per_node=64Gi", "run.dir=/tmp/derive"], check_hardware=False)
        out[kind] = manifest(cfg)[1]
    return out


def main(pytorchjob_crd: str, jobset_crd: str) -> None:
    made = samples()
    for kind, crd, version, source in (("pytorchjob", pytorchjob_crd, "v1", "kubeflow/training-operator v1.9.0 "
                                        "manifests/base/crds/kubeflow.org_pytorchjobs.yaml"),
                                       ("jobset", jobset_crd, "v1alpha2", "kubernetes-sigs/jobset v0.9.1 "
                                        "config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml")):
        doc = yaml.safe_load(Path(crd).read_text())
        schema = next(v for v in doc["spec"]["versions"] if v["name"] == version)["schema"]["openAPIV3Schema"]
        derived = prune(schema, usage([made[kind]]), kind)
        derived["properties"]["metadata"] = OBJECT_META
        _write(f"{kind}.schema.json", f"Derived from {source} (openAPIV3Schema, version {version}) by "
               "derive_schemas.py; see its docstring.", derived)
    _write("configmap.schema.json", "Written from the Kubernetes API's io.k8s.api.core.v1.ConfigMap (kubernetes/"
           "kubernetes api/openapi-spec/v3/api__v1_openapi.json) by derive_schemas.py; see its docstring.", CONFIG_MAP)


def _write(name: str, comment: str, schema: dict) -> None:
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "$comment": comment, **schema}
    (HERE / name).write_text(json.dumps(schema, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:3])
