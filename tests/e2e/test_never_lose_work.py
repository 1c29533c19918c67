"""Runs that never lose work, through the CLI (real processes, gloo, DCP): starting over in a used
run dir is refused unless checkpoint.overwrite=true, which moves the earlier run aside instead of
deleting it; a resume that changes which samples train is refused unless
checkpoint.allow_data_change=true, and its summary shows only its own losses; time-based saves
(checkpoint.interval_minutes) happen at the same step on every rank; the GPU recipes save
periodically and the dry run says when."""

import json

import pytest

from helpers import SMOKE, cli, cli_error, read_metrics, smoke_run, train_ranks

pytestmark = pytest.mark.slow

run = smoke_run


def steps_in(folder):
    return sorted(int(p.name[5:]) for p in folder.glob("step_*") if (p / "manifest.json").is_file())


def test_start_over_and_data_changes_keep_the_earlier_run(tmp_path):
    r = tmp_path / "r"
    # The earlier run, as mfsdp-train's ranks run it (helpers.train_ranks); what follows is the CLI's.
    train_ranks(*SMOKE, f"run.dir={r}", "train.steps=4", "checkpoint.interval=2", "data.val_fraction=0.1")
    assert steps_in(r / "checkpoints") == [2, 4]
    rows = read_metrics(r)
    assert "val_loss" in rows[-1]

    # resume=never would replace step_2 and step_4: one line before spawning, nothing touched.
    line = cli_error(run(r, "train.steps=2", "checkpoint.resume=never", expect=2))
    assert line.startswith("mfsdp-train: error: checkpoint.resume: never, but ") and "step_2, step_4" in line
    assert "checkpoint.overwrite=true" in line and "nothing is deleted" in line
    assert read_metrics(r) == rows and steps_in(r / "checkpoints") == [2, 4] and not (r / "previous").exists()

    # A model change proposes a new run.dir (or overwrite, which keeps the old run), never a bare resume=never.
    line = cli_error(run(r, "train.steps=6", "model.n_layers=3", expect=2))
    assert "model.n_layers" in line and "a new run.dir" in line
    assert line.count("resume=never") == line.count("overwrite=true") == 1
    assert line.index("resume=never") < line.index("overwrite=true")

    # Keys that change which samples train are refused at a resume, naming old and new values.
    line = cli_error(run(r, "train.steps=6", "data.val_fraction=0.2", "train.seq_len=32", expect=2))
    assert line.startswith("mfsdp-train: error: data.val_fraction: 0.2 here but 0.1 in ")
    assert "train.seq_len 64 -> 32" in line and "checkpoint.allow_data_change=true" in line
    assert "resume=never" not in line

    # Allowed when asked. Saves every ~6 ms of training (checkpoint.interval_minutes): both ranks
    # save step 5 together (else DCP's collectives would hang). The summary has no validation
    # loss: this run validates nothing, and step 4's val_loss is the earlier run's.
    out = run(r, "train.steps=6", "data.val_fraction=0.0", "checkpoint.allow_data_change=true",
              "checkpoint.interval=0", "checkpoint.interval_minutes=0.0001")
    assert "resuming from step 4" in out.stdout and "data.val_fraction 0.1 -> 0.0" in out.stdout
    assert "checkpoint step_5 committed" in out.stdout and "checkpoint step_6 committed" in out.stdout
    summary = out.stdout.strip().splitlines()[-1]
    assert summary.startswith("mfsdp-train: finished step 6/6") and "(val" not in summary, summary
    assert steps_in(r / "checkpoints") == [4, 5, 6]  # keep_last=3
    rows = read_metrics(r)
    assert [x["step"] for x in rows if "loss" in x] == [1, 2, 3, 4, 5, 6]

    # Starting over with checkpoint.overwrite=true: the earlier run's files are moved aside.
    out = run(r, "train.steps=2", "checkpoint.resume=never", "checkpoint.overwrite=true")
    prev = r / "previous" / "1"
    moved = next(x for x in out.stdout.splitlines() if "moved to" in x)
    assert moved.startswith("mfsdp-train: checkpoint.overwrite=true: the earlier run's checkpoints/ "
                            "(step_4, step_5, step_6), metrics.jsonl, ")
    assert f"moved to {prev}; nothing is deleted" in moved
    assert steps_in(prev / "checkpoints") == [4, 5, 6]
    assert [json.loads(x) for x in (prev / "metrics.jsonl").read_text().splitlines()] == rows
    assert (prev / "config.yaml").is_file() and (prev / "logs").is_dir()
    assert steps_in(r / "checkpoints") == [2]
    assert [x["step"] for x in read_metrics(r)] == [1, 2]
    assert "starting fresh: checkpoint.resume=never" in out.stdout
    assert "continued from" not in out.stdout and "removed" not in out.stdout
    assert out.stdout.strip().splitlines()[-1].startswith("mfsdp-train: finished step 2/2")


def test_gpu_recipes_save_periodically_and_the_dry_run_says_when(tmp_path):
    from mfsdp_launch.planner.compose import compose

    for recipe in ("fsdp_bf16", "hfsdp_bf16", "hfsdp_fp8", "hsdp_bf16"):
        ck = compose([f"+recipe={recipe}"]).checkpoint
        assert ck.interval > 0 and ck.interval_minutes, recipe
    out = cli("+recipe=fsdp_bf16", "launcher.nproc_per_node=2", "launcher.dry_run=true", f"run.dir={tmp_path}/g")
    assert out.returncode == 0, out.stderr
    assert "checkpoints: every 100 steps or 30 min of training, and at the end; next at step 100" in out.stdout
    out = cli(*SMOKE, "launcher.dry_run=true", "checkpoint.interval_minutes=null", f"run.dir={tmp_path}/c")
    assert "checkpoints: only at the end (step 40): a crash before it keeps nothing" in out.stdout
