"""Per-token loss (rank/token_weights.py) through the product's own wiring and loop, FSDP2 on gloo,
fp32, on a corpus with ragged loss masks: dp=2 x ga=4, dp=1 x ga=8 and dp=1 x ga=2 x mbs=4 give the
same per-step loss and gradients; the first loss is plain PyTorch's mean over every target token
of the global batch (not the mean of the micro-batch means); a dp=2 checkpoint resumes at dp=1 on
the very same labels and the same numbers. One 2-rank job; the dp=1 runs in this process."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch

from helpers import EOS, one_rank_group, read_metrics, run_ranks, train_wired, write_masked_corpus

SEQ, STEPS = 32, 3


def _docs(n: int = 160, seed: int = 0):
    """Chat-like documents: a prompt (no targets) and an answer of very different lengths (targets);
    some have no answer at all, so some micro-batches hold few or no targets."""
    rng = np.random.default_rng(seed)
    docs, masks = [], []
    for i in range(n):
        prompt, answer = int(rng.integers(3, 30)), int(rng.choice([0, 1, 2, 40]))
        tokens = np.append(rng.integers(1, 256, size=prompt + answer), EOS)
        docs.append(tokens)
        masks.append(np.r_[np.zeros(prompt, np.uint8), np.ones(answer + 1, np.uint8) if answer else [0]])
    return docs, masks


def _overrides(corpus: str, run_dir: Path, world: int, ga: int, mbs: int, steps: int):
    return ["model=gpt", "model.preset=tiny", "model.dim=32", "model.n_layers=2", "model.n_heads=4",
            "model.n_kv_heads=2", "model.ffn_dim=64", "model.vocab_size=256", "engine=fsdp2",
            "precision.compute_dtype=fp32", "precision.main_params_dtype=fp32", "data=tokens",
            f"data.sources=[{{path: '{corpus}'}}]", "data.pack=documents", f"train.seq_len={SEQ}",
            f"train.steps={steps}", f"train.grad_accum_steps={ga}", f"train.micro_batch_size={mbs}",
            "train.log_interval=1", "train.grad_clip=null", "train.progress=false", "optim.lr=1e-3",
            "optim.warmup_steps=0", f"launcher.nproc_per_node={world}", f"run.dir={run_dir}",
            "checkpoint.interval=2", "checkpoint.save_final=false", "checkpoint.interval_minutes=null",
            f"data.cache_dir={run_dir}_cache"]


def train_case(rank: int, world: int, corpus: str, run_dir: str, ga: str, mbs: str, steps: str, out: str):
    """helpers.train_wired in this group; saves {per-step gradients, each micro-batch's labels} of
    this rank to `out`.rank<r>.pt."""
    grads, labels = {}, {}
    train_wired(rank, world, _overrides(corpus, Path(run_dir), world, int(ga), int(mbs), int(steps)),
                grads=grads, labels=labels)
    torch.save({"grads": grads, "labels": labels}, f"{out}.rank{rank}.pt")


def _global_labels(saved, world: int, ga: int, step: int):
    """The step's labels in global sample order (micro m of rank r holds samples (m * world + r) * mbs...)."""
    rows = []
    for micro in range(ga):
        for rank in range(world):
            rows.append(saved[rank]["labels"][(step, micro)])
    return torch.cat(rows)


def _max_rel(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-30)).item() for k in b)


def test_per_token_loss_is_independent_of_the_split_and_resumes_at_another_dp(tmp_path):
    docs, masks = _docs()
    corpus = write_masked_corpus(tmp_path / "chat", docs, masks)
    dp2 = tmp_path / "dp2"
    run_ranks(train_case, 2, corpus, str(dp2), 4, 1, STEPS, str(tmp_path / "dp2_out"), timeout=240)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the rank processes: tiny matrices, a shared machine
    with one_rank_group(tmp_path / "store"):
        train_case(0, 1, corpus, str(tmp_path / "ga8"), 8, 1, STEPS, str(tmp_path / "ga8_out"))
        train_case(0, 1, corpus, str(tmp_path / "mbs4"), 2, 4, STEPS, str(tmp_path / "mbs4_out"))
        resumed = tmp_path / "resumed"
        shutil.copytree(dp2 / "checkpoints" / "step_2", resumed / "checkpoints" / "step_2")
        train_case(0, 1, corpus, str(resumed), 8, 1, STEPS, str(tmp_path / "resumed_out"))
        reference = _plain_pytorch_first_step(corpus, tmp_path)
    torch.set_num_threads(threads)

    rows = {name: {r["step"]: r for r in read_metrics(tmp_path / name) if "loss" in r}
            for name in ("dp2", "ga8", "mbs4", "resumed")}
    saved = {name: [torch.load(tmp_path / f"{name}_out.rank{r}.pt") for r in range(world)]
             for name, world in (("dp2", 2), ("ga8", 1), ("mbs4", 1), ("resumed", 1))}
    for name in ("ga8", "mbs4"):
        for step in range(1, STEPS + 1):
            assert abs(rows[name][step]["loss"] - rows["dp2"][step]["loss"]) <= 1e-6 * rows["dp2"][step]["loss"]
            assert _max_rel(saved[name][0]["grads"][step], saved["dp2"][0]["grads"][step]) <= 1e-6, (name, step)
            assert rows[name][step]["target_tokens_per_step"] == rows["dp2"][step]["target_tokens_per_step"]
    # The labels were masked (ragged counts), and the loss is the per-token mean, not the mean of means.
    targets = _global_labels(saved["ga8"], 1, 8, 1)
    counts = (targets != -100).sum(-1)
    assert counts.min() < 5 and counts.max() > 15 and rows["dp2"][1]["target_tokens_per_step"] == counts.sum()
    per_token, mean_of_means = reference
    assert abs(rows["dp2"][1]["loss"] - per_token) <= 1e-6 * per_token
    assert abs(mean_of_means - per_token) > 1e-3 * per_token
    # Resumed at dp=1 from dp=2's step 2: the same labels as the uninterrupted dp=2 run, bitwise,
    # and its step-3 loss and gradients.
    assert sorted(rows["resumed"]) == [3]
    assert torch.equal(_global_labels(saved["resumed"], 1, 8, 3), _global_labels(saved["dp2"], 2, 4, 3))
    assert abs(rows["resumed"][3]["loss"] - rows["dp2"][3]["loss"]) <= 1e-6 * rows["dp2"][3]["loss"]
    assert _max_rel(saved["resumed"][0]["grads"][3], saved["dp2"][0]["grads"][3]) <= 1e-6


def _plain_pytorch_first_step(corpus: str, tmp_path: Path):
    """(per-token mean, mean of micro-batch means) of step 1's 8 samples on the seeded initial
    model, unsharded, with F.cross_entropy."""
    import torch.nn.functional as F

    from mfsdp_launch.components.rng import seed_all
    from mfsdp_launch.data import TokenBatches
    from mfsdp_launch.planner import prepare
    from mfsdp_launch.rank.runtime import build_model

    cfg, _ = prepare(_overrides(corpus, tmp_path / "ref", 1, 8, 1, 1), check_hardware=False)
    seed_all(cfg.train.seed)
    _, model, _, _ = build_model(cfg.model, cfg.fp8, SEQ, torch.device("cpu"))
    batches = TokenBatches(cfg.data, seq_len=SEQ, micro_batch_size=8, vocab_size=256, seed=cfg.train.seed)
    batch = batches.batch(0)
    with torch.no_grad():
        logits = model(batch["input_ids"]).float()
        per_token = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten()).item()
        means = [F.cross_entropy(logits[i], batch["labels"][i]) for i in range(8)]
        mean_of_means = torch.stack([m for m in means if not m.isnan()]).mean().item()
    return per_token, mean_of_means


def test_the_loss_without_a_mask_is_bitwise_as_before_and_zero_without_targets():
    """An unmasked micro-batch's loss and gradient are F.cross_entropy's mean bitwise (pretraining
    keeps its losses); one with no target token gives 0 and no gradient, never NaN."""
    import torch.nn.functional as F

    from mfsdp_launch.models.losses import IGNORE_INDEX, target_mean_cross_entropy

    torch.manual_seed(0)
    logits = torch.randn(3, 37, 101, requires_grad=True)
    labels = torch.randint(0, 101, (3, 37))
    ref = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    (ref_grad,) = torch.autograd.grad(ref, logits)
    got = target_mean_cross_entropy(logits, labels)
    (got_grad,) = torch.autograd.grad(got, logits)
    assert torch.equal(got, ref) and torch.equal(got_grad, ref_grad)
    none = target_mean_cross_entropy(logits, torch.full_like(labels, IGNORE_INDEX))
    (grad,) = torch.autograd.grad(none, logits)
    assert none.item() == 0.0 and not grad.any()
