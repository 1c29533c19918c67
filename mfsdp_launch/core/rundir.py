"""The names of the files in a run directory: one table, imported by every module that reads or
writes one. Standard library only (a leaf: it imports nothing from this package)."""

from __future__ import annotations

CONFIG = "config.yaml"  # the frozen, resolved config every rank loads
OVERRIDES = "overrides.yaml"  # the command-line overrides it was composed from
METRICS = "metrics.jsonl"  # one JSON row per logged step (rank 0)
# Rows mfsdp-eval appends to METRICS: the checkpoint's step and keys under this prefix.
EVAL_PREFIX = "eval/"
EVAL_LOSS = EVAL_PREFIX + "loss"
EVAL_PPL = EVAL_PREFIX + "ppl"
# Rows of steps a rollback undid (train.max_bad_steps, rank/step_guard.py), moved out of METRICS.
ROLLED_BACK_METRICS = "metrics.rolled_back.jsonl"
# The last rows of METRICS again, replaced at every row: a torn last line of METRICS (a crash or a
# full disk mid-write) is restored from it on resume (components/metrics.py).
METRICS_TAIL = "metrics.tail.json"
# Rank 0's position (step, total, time, tokens per step), replaced at most twice a second: the
# launcher's progress bar reads it (rank/progress.py, launcher/progress.py).
PROGRESS = "progress.json"
TENSORBOARD = "tensorboard"
CHECKPOINTS = "checkpoints"
STOP = "STOP"  # touched to ask the workers to checkpoint and exit
LAUNCH_CMD = "launch_cmd.txt"  # the torchrun command line, for people
LOGS = "logs"  # the launcher's log and each rank's stdout/stderr
LAUNCHER_LOG = "launcher.log"  # in LOGS: everything the launcher and torchrun printed
# In LOGS, + the rank: flight recorder dumps (the last collectives) on a stall and on an NCCL timeout.
FLIGHT_RECORDER_STALL = "flight_recorder_stall_rank"
FLIGHT_RECORDER_STALL_NCCL = "flight_recorder_stall_nccl_rank"
FLIGHT_RECORDER_TIMEOUT = "flight_recorder_timeout_rank"
LOCK = "run.lock"  # the owner of the run dir (host, pid); other nodes: run.lock.node<N>
TRACKERS = "trackers.json"  # W&B / MLflow run ids and the last step sent, for a resume
SBATCH_SCRIPT = "sbatch.sh"
SLURM_JOB_ID = "slurm_job_id"
KUBERNETES_MANIFEST = "kubernetes.yaml"  # launcher=kubernetes: the ConfigMap and the PyTorchJob/JobSet
# Sweeps: one directory per point, each a run dir with these beside the files above.
JOB_STATUS = "job_status.json"
JOB_DONE = "DONE"
SWEEP_SUMMARY = "sweep_summary.csv"
SWEEP_SUMMARY_MD = "sweep_summary.md"
REPORT_PNG = "report.png"
REPORT_SUMMARY = "summary.txt"
PROFILE = "profile"  # train.profile's traces (components/profiling.py)
# An earlier run's files, moved here instead of deleted when a run starts over in its run dir
# (checkpoint.overwrite=true) or replaces a later timeline (checkpoint.load_step): previous/<n>/.
PREVIOUS = "previous"
# What a run writes that a new run in the same dir would replace or mix with its own: set aside
# whole when a run starts over (checkpoint/aside.py). The lock, STOP and tracker stores are not.
RUN_OUTPUTS = (CHECKPOINTS, METRICS, METRICS_TAIL, PROGRESS, ROLLED_BACK_METRICS, TENSORBOARD, TRACKERS, CONFIG, OVERRIDES, LAUNCH_CMD, LOGS, PROFILE)
