"""The names of the files in a run directory: one table, imported by every module that reads or
writes one. Standard library only (a leaf: it imports nothing from this package)."""

from __future__ import annotations

CONFIG = "config.yaml"  # the frozen, resolved config every rank loads
OVERRIDES = "overrides.yaml"  # the command-line overrides it was composed from
METRICS = "metrics.jsonl"  # one JSON row per logged step (rank 0)
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
# Sweeps: one directory per point, each a run dir with these beside the files above.
JOB_STATUS = "job_status.json"
JOB_DONE = "DONE"
SWEEP_SUMMARY = "sweep_summary.csv"
SWEEP_SUMMARY_MD = "sweep_summary.md"
REPORT_PNG = "report.png"
REPORT_SUMMARY = "summary.txt"
