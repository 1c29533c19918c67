#!/usr/bin/env bash
# Stage .gpuextra/: the wheels the one-GPU tier needs beyond the device kit (transformers, peft,
# accelerate, torchao, pytest-xdist, jsonschema), for the device's python 3.12, at the versions
# installed here. The device has torch (and torch's own requirements), pytest, rich and einops;
# the kit brings pydantic. Run from the project root after `pip install -e ".[dev]"`:
#   bash tests/gpu/prepare_extra.sh
# then carry ".gpuextra" and, after `bash .devkit/setup.sh base`:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpuextra/*.whl
# The tracked tree, .devkit and .gpuextra together pass a call's 64 MiB carry limit (session 35), so
# this also stages .devlite/: .devkit without what only `setup.sh te` reads (the TE wheels and
# sources, and the cuDNN frontend that TE needs). A call without TE carries ".devlite" and
# ".gpuextra" and runs `bash .devlite/setup.sh base`; before TE, a call carrying .devkit runs
# `bash .devkit/setup.sh base` again (the kit it copies to /tmp/devkit is what `setup.sh te` reads).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
for d in /.gpuextra/ /.devlite/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
mkdir -p .gpuextra
PLAT=(--python-version 3.12 --implementation cp --only-binary=:all: --no-deps
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 - > .gpuextra/requirements.txt <<'EOF'
from importlib import metadata

from packaging.requirements import Requirement

DEVICE = {"python_version": "3.12", "python_full_version": "3.12.0", "extra": ""}


def needed(name):
    """The distributions `name` requires on the device (no extras, markers evaluated for it)."""
    reqs = (Requirement(r) for r in metadata.requires(name) or [])
    return [r.name for r in reqs if r.marker is None or r.marker.evaluate(DEVICE)]


roots = ["transformers", "peft", "accelerate", "pytest-xdist", "jsonschema"]
# On the device already: torch with its requirements, pytest, rich, einops; the kit: pydantic.
present = {"torch", "triton", "pytest", "rich", "einops", "pydantic", "pydantic-core",
           "typing-inspection", "annotated-types", "setuptools"}
for name in ("torch", "pytest", "rich"):
    present.update(n.lower().replace("_", "-") for n in needed(name))
pins, todo = {"torchao": "0.18.0"}, list(roots)
while todo:
    name = todo.pop().lower().replace("_", "-")
    if name in pins or name in present or name.startswith("nvidia-"):
        continue
    pins[name] = metadata.version(name)
    todo.extend(needed(name))
print("\n".join(f"{n}=={v}" for n, v in sorted(pins.items())))
EOF
python3 -m pip download -q "${PLAT[@]}" -d .gpuextra -r .gpuextra/requirements.txt
ls .gpuextra/*.whl | wc -l | xargs echo "wheels:"
du -sh .gpuextra
if [ -d .devkit ]; then
  rm -rf .devlite && mkdir .devlite
  for f in .devkit/*; do
    case "$(basename "$f")" in transformer_engine*|nvidia_cudnn_frontend*) ;; *) ln -f "$f" .devlite/ ;; esac
  done
  du -sh .devlite
fi
