#!/usr/bin/env bash
# NeMo Automodel 0.7.0's packed SFT (bench/peers/automodel_llama1b_packed_sft.yaml) on ONE GPU, for
# the sft_packed group of bench/matrix.yaml; run it in the same device call as
#   python3 scripts/bench.py --group sft_packed
# Needs .peers/ (../shared/peers/prepare.sh) carried to the device, and Transformer Engine for
# attn: te. Log: $OUT/am_packed_sft.log; the last line is the median tps_per_gpu after step 5.
set -u
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
kit=$root/.peers
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
[ -d /tmp/ttsite/torchdata ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ttsite "$kit"/whl/*.whl || exit 1
[ -d /tmp/amsite/nemo_automodel ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/amsite \
  "$kit"/amwhl/*.whl "$kit"/whl/torchdata-*.whl || exit 1
log=$OUT/am_packed_sft.log
t0=$(date +%s)
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} PYTHONPATH=/tmp/amsite:/tmp/ttsite:$kit/stubs${PYTHONPATH:+:$PYTHONPATH} \
  timeout "${T_AM:-400}" torchrun --standalone --nproc-per-node 1 -m nemo_automodel.cli.app \
  "$root"/bench/peers/automodel_llama1b_packed_sft.yaml > "$log" 2>&1
echo "rc=$? wall_s=$(( $(date +%s) - t0 ))" >> "$log"
python3 - "$log" <<'PY'
import re, statistics, sys
text = open(sys.argv[1], errors="replace").read()
# its line: "step N | epoch E | loss ... | tps T(P/gpu) | num_label_tokens K"
steps = [(int(s), float(t)) for s, t in re.findall(r"step (\d+) \|[^\n]*?tps [0-9.]+\(([0-9.]+)/gpu\)", text)]
late = [t for s, t in steps if s > 5]
print(f"automodel packed SFT: {len(steps)} steps logged; median tps_per_gpu after step 5: "
      f"{statistics.median(late) if late else 'n/a'}; THD packing on: {'THD-packing dataset' in text}")
PY
tail -1 "$log"
