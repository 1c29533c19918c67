#!/usr/bin/env bash
# The GPU work of one device call, after the devkit setup (see /work/shared/device/README.md):
#   source /tmp/devkit/env.sh; bash tests/gpu/device_run.sh PHASE [SECONDS]
# Phases: smoke (optimizer/resume/no-mesh/frozen/dtype cases), core (the other non-TE GPU tests),
# tests (the files in $TESTS), bench (scripts/bench.py $BENCH),
# e2e_bench_gpt (CLI runs + the 1.4B GPT benchmark), te (TE GPU tests + the TE model tests),
# te_e2e_bench (the TE CLI runs: FP8 recipe, CUDA graph, fp8.skip + TE benchmarks and profiles),
# te_parallel (te_gpt tp=2/cp=2 vs 1, tp reshard, TE activation checkpointing; after `setup.sh te`),
# one_gpu (the one-GPU tier: every test marked gpu and not multi_gpu, in one call: pytest-xdist's
# ONE_GPU_WORKERS files at a time on the one GPU (the tests are tiny, their time is start-up on
# the CPU), the slow files first; without TE its TE tests skip, so run it after `setup.sh te` for
# the whole tier; ONE_GPU_ARGS replaces the files, e.g. to run one),
# generate (scripts/bench_generate.py on the 1.4b gpt, then +recipe=fsdp_bf16 as shipped for 60 steps),
# peers (scripts/bench_peers.py $PEERS: torchtitan and this launcher side by side; carry .peers).
# BENCH overrides a phase's bench.py arguments (e.g. BENCH="--group gpt_pair").
# Logs go to $OUT: <phase>.log plus one tarball of the job logs and bench results.
#
# One call, after `bash .devlite/setup.sh base` (carry .devlite and .gpuextra, which tests/gpu/prepare_extra.sh
# stages: with .devkit whole they pass the 64 MiB carry limit; TE's parts need calls of their own and
# the whole .devkit, /work/shared/device/README.md):
# `bash tests/gpu/device_run.sh one_gpu 420` runs the whole one-GPU tier (session 15: 104 passed,
# 47 skipped for want of TE, in 5:52), and `bench` a scripts/bench.py selection. The machine is
# given back after ~30 s idle: have the next call ready. Never `pkill -f` a word of the call's own
# command line (session 18's `pkill -f pytest` killed the call that ran it).
set -uo pipefail
phase=${1:?phase}
budget=${2:-480}
export MFSDP_GPU_TEST_LOGS=/tmp/mfsdp_gpu_logs/$phase
mkdir -p "$MFSDP_GPU_TEST_LOGS" bench
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
log="$OUT/$phase.log"
start=$(date +%s)
{
  echo "== $phase on $(hostname) $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
} 2>&1 | tee "$log"
# Ranks a killed test left behind would share the GPUs with the next run (and skew a benchmark).
# By the PIDs holding the GPU, never by a pattern: `pkill -f` matches the call's own command line
# whenever it names the same words (session 20's first call killed itself that way).
reap() {
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do
    kill -9 "$pid" 2>/dev/null
  done
  sleep 2
}
# The device has no pytest-xdist: drop pyproject's `-n auto` (GPU tests run one at a time anyway).
# -v: a line per test as it ends, so a call that runs out of time still says which tests passed
# (session 13 lost two summary lines to `timeout`).
PYTEST="python3 -m pytest -o addopts=-ra -p no:cacheprovider -v -m gpu"
SMOKE="test_first_updates_equal_plain_adamw or test_resume or test_fully_shard_ez or test_model_with_frozen or test_fully_shard_custom_dtype"
case "$phase" in
  smoke)
    timeout "$budget" $PYTEST tests/gpu/test_megatron_fsdp.py -k "$SMOKE" 2>&1 | tee -a "$log" ;;
  core)
    timeout "$budget" $PYTEST tests/gpu/test_megatron_fsdp.py -k "not ($SMOKE)" 2>&1 | tee -a "$log" ;;
  e2e_bench_gpt)
    timeout 240 $PYTEST tests/gpu/test_e2e.py -k "not test_te_" -s 2>&1 | tee -a "$log"; reap
    left=$(( budget - ($(date +%s) - start) ))
    timeout "$left" python3 scripts/bench.py ${BENCH:---group gpt} 2>&1 | tee -a "$log" ;;
  te)
    timeout "$budget" $PYTEST tests/unit/models/test_models.py tests/gpu/test_te_megatron_fsdp.py 2>&1 | tee -a "$log" ;;
  tests)  # TESTS: the test files (and -k ...) to run, e.g. TESTS="tests/gpu/test_cp_gpu.py"
    timeout -k 10 "$budget" $PYTEST ${TESTS:?TESTS} 2>&1 | tee -a "$log" ;;
  bench)  # BENCH: bench.py arguments, e.g. BENCH="--group ac_peak --group ac8b"
    timeout -k 10 "$budget" python3 scripts/bench.py ${BENCH:?BENCH} 2>&1 | tee -a "$log" ;;
  one_gpu)  # the one-GPU tier (`-m "gpu and not multi_gpu"` over all of tests/); ONE_GPU_ARGS: other files
    # pytest-xdist comes in .gpuextra/ (the device has none): a file per worker, whole, in the order
    # below (--no-loadscope-reorder), so the files whose few tests take a minute each start first.
    # Without xdist the same tests run one after another.
    xdist=()
    python3 -c "import xdist" 2>/dev/null && xdist=(-n "${ONE_GPU_WORKERS:-4}" --dist loadfile --no-loadscope-reorder)
    slow_first="tests/gpu/test_sft_gpu.py tests/gpu/test_lora_gpu.py tests/gpu/test_hf_moe_gpu.py \
      tests/gpu/test_moe_gpu.py tests/gpu/test_one_gpu_features.py tests/gpu/test_every_tool_gpu.py tests"
    MFSDP_ONE_GPU_PARALLEL=${MFSDP_ONE_GPU_PARALLEL:-4} timeout -k 10 "$budget" python3 -m pytest -o addopts=-ra \
      -p no:cacheprovider -v "${xdist[@]}" -m "gpu and not multi_gpu" ${ONE_GPU_ARGS:-$slow_first} 2>&1 | tee -a "$log"
    reap ;;
  generate)  # scripts/bench_generate.py: mfsdp-generate on the 1.4b gpt (issue 29), then fsdp_bf16 as shipped
    # (the 1.4b gpt compiled: ~1 min of compile, then ~0.15 s a step)
    timeout -k 10 "$budget" python3 scripts/bench_generate.py --run-dir /tmp/gen14 > "$OUT/generate.json" 2>>"$log"
    cat "$OUT/generate.json" | tee -a "$log"; reap
    timeout -k 10 180 python3 -m mfsdp_launch +recipe=fsdp_bf16 train.steps=60 train.log_interval=20 \
      checkpoint.save_final=false run.dir=/tmp/recipe_fsdp_bf16 2>&1 | tail -6 | tee -a "$log"; reap ;;
  peers)  # PEERS: scripts/bench_peers.py arguments (e.g. PEERS="--world 1 --only tt_compile --only mfsdp_compile");
    # needs .peers carried. Its rows come back as $OUT/peers_rows.json, the logs in the artifacts tarball.
    timeout -k 10 "$budget" python3 scripts/bench_peers.py ${PEERS:?PEERS} --logs "$MFSDP_GPU_TEST_LOGS/peers" 2>&1 \
      | tee -a "$log"; reap
    cp "$MFSDP_GPU_TEST_LOGS/peers/peers_rows.json" "$OUT/" 2>/dev/null ;;
  te_parallel)
    timeout "$budget" $PYTEST tests/gpu/test_te_parallel_gpu.py -s 2>&1 | tee -a "$log" ;;
  te_e2e_bench)
    timeout 400 $PYTEST tests/gpu/test_e2e.py -k test_te_ -s 2>&1 | tee -a "$log"; reap
    left=$(( budget - ($(date +%s) - start) ))
    timeout "$left" python3 scripts/bench.py ${BENCH:---group te --group te_profile} 2>&1 | tee -a "$log" ;;
  *)
    echo "unknown phase $phase" | tee -a "$log" ;;
esac
echo "== $phase done in $(( $(date +%s) - start )) s" | tee -a "$log"
cp bench/bench.log "$OUT/bench_$phase.log" 2>/dev/null
tar czf "$OUT/$phase-artifacts.tgz" --exclude='*.distcp' --exclude=token_cache --exclude='*.pt' \
  --exclude=checkpoints -C / "${MFSDP_GPU_TEST_LOGS#/}" -C "$PWD" bench 2>/dev/null
ls -la "$OUT"
