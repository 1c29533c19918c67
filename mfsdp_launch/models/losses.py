"""How a batch becomes the scalar loss: the built-in families' next-token cross-entropy (torch, or
TE's fused kernel) and `model=custom`/`model=hf`'s batch contracts (docs/models.md)."""

from __future__ import annotations

import functools
import inspect
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch
    from torch import nn

IGNORE_INDEX = -100  # F.cross_entropy's default, kept by the fused kernel too


def _gpt_logits(model: "nn.Module", batch: dict) -> "torch.Tensor":
    """A batch with "doc_ids" (data.doc_mask) passes them on, so that attention stays inside each
    document."""
    doc_ids = batch.get("doc_ids")
    if doc_ids is None:
        return model(batch["input_ids"])
    cu = batch.get("cu_seqlens")
    return model(batch["input_ids"], doc_ids=doc_ids) if cu is None else model(batch["input_ids"], doc_ids=doc_ids,
                                                                                cu_seqlens=cu)


def target_count(labels: "torch.Tensor") -> "torch.Tensor":
    """The target tokens (labels != IGNORE_INDEX), at least 1: a mean over none is 0, not NaN."""
    return (labels != IGNORE_INDEX).sum().clamp(min=1)


# train.compile on a GPU compiles the cross-entropy too (models/compile.py turns it on), as
# torchtitan compiles its loss: Inductor reads the bf16 logits in one pass per reduction and writes
# their gradient in one kernel, where eager makes an fp32 copy, a log-softmax, its saved output and
# as many passes back (at a 152k vocabulary, ~10 ms of a 140 ms MoE step on one H200).
_COMPILED_CE: dict = {"on": False, "fn": None}


def compile_cross_entropy() -> None:
    """From now on in this process, CUDA logits go through a torch.compile'd cross-entropy."""
    _COMPILED_CE["on"] = True


def summed_cross_entropy(logits: "torch.Tensor", labels: "torch.Tensor") -> "torch.Tensor":
    """Sum of the cross-entropy over the target tokens, in fp32 (logits [..., vocab], labels [...])."""
    if _COMPILED_CE["on"] and logits.is_cuda:
        if _COMPILED_CE["fn"] is None:
            import torch

            _COMPILED_CE["fn"] = torch.compile(plain_summed_cross_entropy, dynamic=False)
        return _COMPILED_CE["fn"](logits, labels)
    return plain_summed_cross_entropy(logits, labels)


def plain_summed_cross_entropy(logits: "torch.Tensor", labels: "torch.Tensor") -> "torch.Tensor":
    """summed_cross_entropy in eager torch ops."""
    import torch.nn.functional as F

    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def target_mean_cross_entropy(logits: "torch.Tensor", labels: "torch.Tensor") -> "torch.Tensor":
    """Mean cross-entropy over the target tokens (labels != IGNORE_INDEX), in fp32: 0, not NaN, for
    a micro-batch without any (a loss-masked SFT batch can hold none; the loop then weighs it 0).
    Bitwise F.cross_entropy's mean otherwise (its mean is this sum over the same count)."""
    return summed_cross_entropy(logits, labels) / target_count(labels)


def lm_loss(model: "nn.Module", batch: dict) -> "torch.Tensor":
    """Mean next-token cross-entropy over the target tokens, computed in fp32."""
    return target_mean_cross_entropy(_gpt_logits(model, batch), batch["labels"])


def te_fused_lm_loss(model: "nn.Module", batch: dict) -> "torch.Tensor":
    """`lm_loss` through TE's fused cross-entropy (model.loss_kernel=te_fused): one kernel reads the
    bf16 logits and computes the loss in fp32, instead of an fp32 copy of the logits, a log-softmax
    and its saved output (at a 128k vocabulary, 1.5 MB per token). Nothing else reads the logits, so
    backward may write their gradient over them (TE >= 2.20's overwrite_input)."""
    from transformer_engine.pytorch.cross_entropy import parallel_cross_entropy

    labels = batch["labels"]
    in_place = {"overwrite_input": True} if _te_ce_overwrites(parallel_cross_entropy) else {}
    per_token = parallel_cross_entropy(_gpt_logits(model, batch), labels, reduce_loss=False, ignore_idx=IGNORE_INDEX,
                                       **in_place)
    return per_token.sum() / target_count(labels)


@functools.lru_cache(maxsize=None)
def _te_ce_overwrites(fn: Callable) -> bool:
    return "overwrite_input" in inspect.signature(fn).parameters


def loss_for(kernel) -> Callable:
    """The loss function of a `model.loss_kernel` value."""
    return te_fused_lm_loss if str(kernel) == "te_fused" else lm_loss


# --- model=custom / model=hf: the batch contract (model.loss) -------------------------------------


def output_logits(out: Any) -> "torch.Tensor":
    """The logits of a model's output: a tensor, a tuple's first item, or an HF output's `.logits`."""
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def cross_entropy_loss(model: "nn.Module", batch: dict) -> "torch.Tensor":
    """Mean next-token cross-entropy (fp32) of `model(input_ids)`'s logits against the
    pre-shifted labels."""
    logits, labels = output_logits(model(batch["input_ids"])), batch["labels"]
    if logits.ndim != labels.ndim + 1 or logits.shape[:-1] != labels.shape:
        raise RuntimeError(f"model.loss=cross_entropy: the model returned {tuple(logits.shape)} for input_ids "
                           f"{tuple(labels.shape)}; the contract is logits [B, T, vocab]")
    return target_mean_cross_entropy(logits, labels)


def hf_logits(model: "nn.Module", batch: dict) -> "torch.Tensor":
    """model=hf's output on a batch; with "doc_ids" (data.doc_mask) attention runs per document,
    positions restarting in each (models/doc_attention.py)."""
    if batch.get("doc_ids") is None:
        return output_logits(model(batch["input_ids"]))
    from .doc_attention import hf_document_logits

    return hf_document_logits(model, batch["input_ids"], batch["doc_ids"], batch.get("cu_seqlens"))


def hf_loss(model: "nn.Module", batch: dict) -> "torch.Tensor":
    """`cross_entropy_loss` for model=hf, documents kept apart under data.doc_mask."""
    if batch.get("doc_ids") is None:
        return cross_entropy_loss(model, batch)
    return target_mean_cross_entropy(hf_logits(model, batch), batch["labels"])


def model_loss(model: "nn.Module", batch: dict) -> "torch.Tensor":
    """The scalar loss `model(input_ids, labels)` returns (a tensor or an output with .loss)."""
    out = model(batch["input_ids"], batch["labels"])
    loss = out.loss if hasattr(out, "loss") else out
    if not hasattr(loss, "ndim") or loss.ndim != 0:
        shape = tuple(loss.shape) if hasattr(loss, "shape") else type(loss).__name__
        raise RuntimeError(f"model.loss=model: forward(input_ids, labels) returned {shape}, not a scalar loss")
    return loss
