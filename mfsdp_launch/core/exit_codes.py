"""The exit codes of `mfsdp-train` (and of the sbatch script it writes): one table, imported by the
launcher, the sweep, the SLURM script writer, `--help` and the tests. Standard library only."""

from __future__ import annotations

OK = 0  # the run reached train.steps (or had already reached it: nothing to do)
FAILED = 1  # training failed: a rank crashed or was killed, or torchrun could not start the job
CONFIG = 2  # refused before anything started: a bad config, an unusable or busy run.dir
INTERRUPTED = 3  # stopped on request (Ctrl-C, SIGTERM, SIGHUP, SIGUSR1, a STOP file) after saving a checkpoint
ABORTED = 4  # stopped on a second request without waiting for the checkpoint of the last steps
DIVERGED = 5  # stopped: bad (non-finite) steps went on after train.max_rollbacks rollbacks; checkpoints intact

MEANING = {
    OK: "finished: the run reached train.steps (or already had: nothing to do)",
    FAILED: "training failed (a rank crashed or was killed); the failing rank's traceback is shown",
    CONFIG: "bad config, bad arguments, or run.dir unusable or in use by another run; nothing started",
    INTERRUPTED: "stopped on request (Ctrl-C, SIGTERM/HUP/USR1, STOP file), checkpoint saved: re-run to resume",
    ABORTED: "stopped by a second request without saving: re-run resumes from the last checkpoint",
    DIVERGED: "stopped: non-finite loss/grad norm for train.max_bad_steps steps in a row after "
              "train.max_rollbacks rollbacks; the committed checkpoints are intact",
}


def help_text() -> str:
    """The exit-code lines of `mfsdp-train --help`."""
    return "exit codes:\n" + "".join(f"  {code}  {text}\n" for code, text in MEANING.items())
