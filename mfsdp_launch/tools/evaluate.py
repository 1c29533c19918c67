"""`mfsdp-eval RUN --data TOKEN_SET`: loss and perplexity of a run's checkpoint on a token set.

    mfsdp-eval runs/cpu_smoke --data held_out/                  # the newest intact checkpoint
    mfsdp-eval runs/cpu_smoke --data held_out/ --all --plot eval.png

TOKEN_SET is anything `data=tokens` reads (a `mfsdp-data prepare` directory, a Megatron prefix, a
flat .bin, a glob). Its samples are cut as the run cut its training data (its seq_len, seed,
data.pack, data.doc_mask and data.eos_id; `--seq-len`/`--seed` override), and sample g is the
one a `data.val_sources=[TOKEN_SET]` validation of the run reads as its g-th: by default one pass
over the set (every window once), or the first `--samples`. The loss is the mean next-token
cross-entropy over all their target tokens: every token, or on a loss-masked set (chat data,
`mfsdp-data prepare --chat`) only those its mask selects, each weighing the same across batches
as in training's per-token loss; perplexity is exp(loss), "eval/tokens" the target count.
`--all` evaluates every intact checkpoint of the run and prints a table (`--plot FILE`: loss and
perplexity over steps, with matplotlib). One process, on a GPU if there is one (`--device`).
Each result is appended to the run's metrics.jsonl as a row {"step", "eval/loss", "eval/ppl",
"eval/tokens", "eval/data"}, which `mfsdp-report` shows (`--no-record`: don't). Bad input: one
line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import List, Optional

from ..core import rundir
from ..core.errors import ConfigError
from .tool_cli import OneLineParser, run_tool

PROG = "mfsdp-eval"


def eval_dataset(data: str, config: dict, *, seq_len: int, seed: int, vocab_size: int):
    """The corpus TokenDataset of TOKEN_SET, cut as the run's training data was."""
    from ..corpus import TokenDataset

    d = config.get("data") or {}
    try:
        return TokenDataset([{"path": data, "weight": 1.0}], seq_len=seq_len, seed=seed, split="all",
                            pack=str(d.get("pack") or "windows"), eos_id=d.get("eos_id"),
                            cache_dir=d.get("cache_dir"), model_vocab=vocab_size, key="--data")
    except ConfigError as exc:
        raise ConfigError("--data", f"{exc.key}: {exc.problem}" if exc.key != "--data" else exc.problem,
                          exc.allowed) from None


def evaluate(pm, dataset, *, samples: int, batch_size: int, doc_mask: bool) -> dict:
    """{"loss", "ppl", "tokens", "samples"} of `pm` (a PlainModel of a run) over samples 0..samples-1.
    The loss is per target token: each batch's mean over its targets weighs by their count, as the
    training loop's per-token loss does (rank/token_weights.py); a loss-masked set (chat data) has
    targets only where its mask says, read as training reads it (data/batches.py masked_batch)."""
    import torch

    from ..data.batches import masked_batch
    from ..rank.token_weights import target_count

    total, tokens = 0.0, 0
    with torch.inference_mode():
        for start in range(0, samples, batch_size):
            n = min(batch_size, samples - start)
            if dataset.has_loss_mask:
                batch = {k: v.to(pm.device) for k, v in masked_batch(dataset, start, n, doc_mask).items()}
            else:
                rows = dataset.batch_numpy(start, n, with_docs=doc_mask)
                w = torch.from_numpy(rows[0] if doc_mask else rows).to(pm.device)
                batch = {"input_ids": w[:, :-1], "labels": w[:, 1:]}
                if doc_mask:
                    batch["doc_ids"] = torch.from_numpy(rows[1][:, :-1]).to(pm.device)
            targets = int(target_count(batch))
            total += pm.spec.loss(pm.model, batch).float().item() * targets
            tokens += targets
    if not tokens:
        raise ConfigError("--data", f"its loss mask selects no target token in the {samples} samples evaluated",
                          "a token set with assistant turns, or more --samples")
    loss = total / tokens
    return {"loss": loss, "ppl": math.exp(loss) if loss < 700 else float("inf"), "tokens": tokens, "samples": samples}


def record(run_dir: Path, rows: List[dict]) -> Path:
    """Append eval rows to the run's metrics.jsonl in one write (a training may be appending too)."""
    path = run_dir / rundir.METRICS
    with open(path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return path


def plot(rows: List[dict], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in zip(axes, (rundir.EVAL_LOSS, rundir.EVAL_PPL), ("eval loss", "eval perplexity")):
        ax.plot(steps, [r[key] for r in rows], marker="o")
        ax.set_xlabel("step")
        ax.set_title(label)
        ax.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def run(args) -> int:
    from . import plain_model

    if plain_model.is_hf_dir(args.run):
        raise ConfigError("RUN", f"{args.run} is a Hugging Face directory; mfsdp-eval evaluates a run's checkpoints")
    for key, value in (("--samples", args.samples), ("--batch-size", args.batch_size), ("--seq-len", args.seq_len)):
        if value is not None and value < 1:
            raise ConfigError(key, f"must be >= 1, got {value}")
    if args.all and args.step is not None:
        raise ConfigError("--all", "and --step both name the checkpoints", "one of them")
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise ConfigError("--plot", "needs matplotlib (pip install 'mfsdp-launch[report]')")
    device = plain_model.pick_device(args.device)
    dtype = plain_model.pick_dtype(args.dtype, device)
    steps = plain_model.checkpoint_steps(args.run) if args.all else [args.step]
    rows, dataset, header, run_dir = [], None, None, None
    for step in steps:
        pm = plain_model.load(args.run, step=step, device=device, dtype=dtype, prog=PROG)
        if pm.spec is None or not pm.spec.uses_tokens:
            raise ConfigError("RUN", f"model={pm.family} has no token loss to evaluate here", "gpt|te_gpt|custom")
        train, data_cfg = pm.config.get("train") or {}, pm.config.get("data") or {}
        seq_len, seed = args.seq_len or int(train["seq_len"]), args.seed if args.seed is not None else int(train["seed"])
        if dataset is None:
            dataset = eval_dataset(args.data, pm.config, seq_len=seq_len, seed=seed, vocab_size=pm.spec.vocab_size)
            samples = args.samples or sum(p.count for p in dataset.packers)  # one pass: every window once
            masked = " (loss-masked: its target tokens only)" if dataset.has_loss_mask else ""
            header = (f"{PROG}: {args.run} on {args.data}{masked}: {samples:,} samples of {seq_len} tokens "
                      f"(seed {seed}), {device.type} {str(dtype).replace('torch.', '')}")
            print(header, flush=True)
            print(f"  {'step':>8}  {'loss':>9}  {'ppl':>10}  {'tokens':>12}", flush=True)
        res = evaluate(pm, dataset, samples=samples, batch_size=args.batch_size or int(train["micro_batch_size"]),
                       doc_mask=bool(data_cfg.get("doc_mask")))
        row = {"step": pm.step, rundir.EVAL_LOSS: res["loss"], rundir.EVAL_PPL: res["ppl"],
               rundir.EVAL_PREFIX + "tokens": res["tokens"], rundir.EVAL_PREFIX + "data": str(args.data)}
        rows.append(row)
        print(f"  {pm.step:>8}  {res['loss']:>9.4f}  {res['ppl']:>10.3f}  {res['tokens']:>12,}", flush=True)
        run_dir = pm.run_dir
    if args.plot:
        plot(rows, args.plot, header or "")
        print(f"{PROG}: wrote {args.plot}")
    if run_dir is not None and not args.no_record:
        print(f"{PROG}: appended {len(rows)} eval row(s) to {record(run_dir, rows)}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Loss and perplexity of a run's checkpoint(s) on a prepared token set.")
    p.add_argument("run", metavar="RUN", help="run dir, checkpoints/ or step_<N> dir")
    p.add_argument("--data", required=True, metavar="TOKEN_SET", help="a prepared token set (what data=tokens reads)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest intact one)")
    p.add_argument("--all", action="store_true", help="every intact checkpoint of the run, as a table")
    p.add_argument("--samples", type=int, default=None, help="evaluate the first N samples (default: one pass)")
    p.add_argument("--batch-size", type=int, default=None, help="samples per forward (default: train.micro_batch_size)")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default: train.seq_len)")
    p.add_argument("--seed", type=int, default=None, help="where the windows fall (default: train.seed)")
    p.add_argument("--plot", metavar="FILE", default=None, help="PNG of loss and perplexity over the steps")
    p.add_argument("--no-record", action="store_true", help="do not append eval/* rows to the run's metrics")
    p.add_argument("--device", default="auto", help="auto (a GPU if there is one) | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="fp32", help="fp32 (default) | bf16 | fp16 | auto")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    return run_tool(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
