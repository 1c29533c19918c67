"""`model.loss_kernel=chunked` (model=hf): the output head and the cross-entropy run over chunks of
tokens, each chunk recomputed in backward, so the [tokens, vocab] logits never exist whole.

At a 128k vocabulary the plain loss holds, per token, the bf16 logits, their fp32 copy and the
log-softmax that cross-entropy saves (10 bytes a logit: 1.3 MB a token, 42 GB at 32k tokens), more
than activation checkpointing leaves of the whole model. Here one chunk's logits exist at a time,
forward and backward, for a second run of the head's matmul in backward (measured on one H200: 7-9 %
of the tokens/s of a Llama-3.2-1B shape at seq 8192, bench/reports/2026-12-02-session15-*). The
cost is the same on every engine: the head runs inside the model's own forward, so its weights are
gathered exactly as for the plain head.

How: `install(model)` gives the HF model's output embeddings (a plain nn.Linear) a forward that,
while `labels_for(head, labels)` is open, returns the summed cross-entropy of its input against
those labels instead of logits; the loss `chunked(hf_logits)` opens it around the model's forward.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    import torch
    from torch import nn

# Logits per chunk: 2^27 (134M) elements, 1.9 GB in flight at 14 bytes each, whatever the vocab.
CHUNK_LOGITS = 1 << 27
LABELS = "_mfsdp_chunked_labels"  # the head's attribute that holds the open call's labels
_HEADS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> its installed head


def chunk_tokens(vocab_size: int) -> int:
    return max(1, CHUNK_LOGITS // max(vocab_size, 1))


def chunk_loss_bytes(vocab_size: int, tokens: int, dim: int = 0) -> int:
    """Bytes the chunked loss holds at its peak (the memory estimate): one chunk's bf16 logits, fp32
    copy, log-softmax and its gradient, and, in backward, the head weight's gradient being summed
    over the chunks next to the one a chunk adds (fp32, `dim` wide)."""
    return min(tokens, chunk_tokens(vocab_size)) * vocab_size * 14 + 2 * vocab_size * dim * 4


def _chunk_sum(hidden, weight, bias, labels):
    import torch.nn.functional as F

    from .losses import summed_cross_entropy

    return summed_cross_entropy(F.linear(hidden, weight, bias), labels)


def cross_entropy_sum(hidden: "torch.Tensor", weight: "torch.Tensor", bias: Optional["torch.Tensor"],
                      labels: "torch.Tensor", chunk: Optional[int] = None) -> "torch.Tensor":
    """Sum over the target tokens of cross-entropy(hidden @ weight.T + bias, labels), in fp32, a
    chunk of tokens at a time (each recomputed in backward)."""
    import torch
    from torch.utils.checkpoint import checkpoint

    hidden, labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if hidden.shape[0] != labels.shape[0]:
        raise RuntimeError(f"model.loss_kernel=chunked: the head saw {hidden.shape[0]} tokens for "
                           f"{labels.shape[0]} labels")
    step = chunk or chunk_tokens(weight.shape[0])
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for start in range(0, hidden.shape[0], step):
        end = start + step
        total = total + checkpoint(_chunk_sum, hidden[start:end], weight, bias, labels[start:end],
                                   use_reentrant=False)
    return total


def install(model: "nn.Module") -> "nn.Module":
    """Give `model`'s output embeddings the chunked forward (plain logits outside `labels_for`)."""
    problem = chunked_problem(model)  # (the probe refuses these before spawning)
    if problem:
        raise RuntimeError(f"model.loss_kernel=chunked: {type(model).__name__} {problem}")
    head = model.get_output_embeddings()
    plain = head.forward

    def forward(x):
        labels = head.__dict__.get(LABELS)
        return plain(x) if labels is None else cross_entropy_sum(x, head.weight, head.bias, labels)

    head.forward = forward
    _HEADS[model] = head
    return model


def chunked_problem(model: "nn.Module") -> str:
    """'' when `install` applies to this (meta-device) HF model, else why not (one clause)."""
    from torch import nn

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return f"its output head is {type(head).__name__}, not an nn.Linear"
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "final_logit_softcapping", None):  # the model changes the logits after its head
        return f"it soft-caps its logits (final_logit_softcapping={text.final_logit_softcapping})"
    return ""


def _head_of(model: "nn.Module") -> "nn.Module":
    for m in model.modules():  # the engine's wrapper, or the installed model itself
        if m in _HEADS:
            return _HEADS[m]
    raise RuntimeError("model.loss_kernel=chunked: the model's head was not installed")


@contextlib.contextmanager
def labels_for(head: "nn.Module", labels: "torch.Tensor"):
    head.__dict__[LABELS] = labels
    try:
        yield
    finally:
        head.__dict__.pop(LABELS, None)


def chunked(forward_logits: Callable) -> Callable:
    """A loss from `forward_logits(model, batch)` (the model's logits output) whose head returns
    the summed cross-entropy instead: the mean over the batch's target tokens, as the plain loss."""

    def loss(model, batch):
        from .losses import target_count

        labels = batch["labels"]
        with labels_for(_head_of(model), labels):
            total = forward_logits(model, batch)
        return total / target_count(labels)

    return loss
