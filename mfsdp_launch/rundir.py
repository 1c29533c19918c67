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
LOCK = "run.lock"  # the owner of the run dir (host, pid)
SBATCH_SCRIPT = "sbatch.sh"
SLURM_JOB_ID = "slurm_job_id"
# Sweeps: one directory per point, each a run dir with these beside the files above.
JOB_STATUS = "job_status.json"
JOB_DONE = "DONE"
SWEEP_SUMMARY = "sweep_summary.csv"
REPORT_PNG = "report.png"
REPORT_SUMMARY = "summary.txt"
