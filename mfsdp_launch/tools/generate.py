"""`mfsdp-generate RUN_OR_DIR --prompt TEXT`: text from a checkpoint of a run, or from a Hugging
Face directory, on one GPU or the CPU.

    mfsdp-generate runs/cpu_smoke --prompt "def main(" --max-new-tokens 64
    mfsdp-generate runs/x --prompts prompts.txt --temperature 0.8 --top-p 0.95 --step 400
    mfsdp-generate hf_out/ --prompt "Hello" --chat

RUN_OR_DIR is a run, `checkpoints/` or step directory (the newest intact checkpoint unless
`--step`), or an HF directory. Decoding is greedy at `--temperature 0` (the default), else
sampled, after `--top-k` and `--top-p` (nucleus) filtering. `model=gpt` decodes with a KV cache
(models/llama/kv_cache.py), on a GPU through fused Triton kernels replayed as one CUDA graph
(models/llama/fused_decode.py; `--decoder` picks another step); `model=hf` and HF directories use
transformers' `generate` with its cache. `--chat` wraps each prompt in the tokenizer's chat
template. The tokenizer is the run's (tools/run_tokenizer.py) or `--tokenizer`. Each completion is
printed with the new tokens and tokens/s; `--json` prints one JSON object per prompt instead. Bad
input: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import List, Optional

from ..core.errors import ConfigError
from .tool_cli import OneLineParser, run_tool

PROG = "mfsdp-generate"


def sample_next(logits, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, generator=None):
    """Next token ids [B] from logits [B, vocab]: argmax at temperature 0, else a draw from the
    softmax of logits / temperature restricted to the top_k ids and the top_p probability mass."""
    import torch

    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        probs, order = torch.sort(torch.softmax(logits, dim=-1), dim=-1, descending=True)
        outside = probs.cumsum(dim=-1) - probs > top_p  # the mass before a token already covers top_p
        logits = logits.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator).squeeze(-1)


def generate_gpt(model, prompt: List[int], *, max_new_tokens: int, eos_id: Optional[int], cache=None, step=None,
                 generator=None, **sampling) -> List[int]:
    """New token ids after `prompt` for the built-in gpt, batch 1, with a KV cache (`cache`, `step`:
    a preallocated cache and a captured decode step, see `graphed_decoder`). Greedy decoding keeps
    each argmax on the device (GreedyLoop); sampling draws on the host's side of each step."""
    import torch

    from ..models.llama.kv_cache import KVCache, decode_step, prefill

    device = model.tok_emb.weight.device
    cache = cache or KVCache.for_model(model, 1, len(prompt) + max_new_tokens)
    step = step or decode_step
    logits = prefill(model, torch.tensor([prompt], device=device), cache)[:, -1]
    pos = torch.tensor(len(prompt), device=device)
    if sampling.get("temperature", 0.0) <= 0 and max_new_tokens > 0:
        loop = getattr(step, "greedy", None)
        if loop is None or loop.cache is not cache:
            loop = GreedyLoop(model, step, cache, max_new_tokens)
        return loop.run(logits, pos, max_new_tokens, eos_id)
    out = []
    for i in range(max_new_tokens):
        token = sample_next(logits, generator=generator, **sampling)
        out.append(token)
        if eos_id is not None and token.item() == eos_id:  # a sync per token, only when stopping at EOS
            break
        if i + 1 < max_new_tokens:
            logits = step(model, token.view(1, 1), pos, cache)[:, -1]
            pos += 1
    return torch.cat(out).tolist() if out else []


class GreedyLoop:
    """Greedy decoding whose argmax never leaves the device: one `body` a token (the decode step at
    `pos`, its argmax into `token` and into `ids[count]`, then pos and count + 1). On a GPU
    `graphed_decoder` captures the body in CUDA graphs, once and `check_every` times over, so a
    chunk of tokens costs one replay and no host round trip; elsewhere the same body runs eagerly.
    EOS is looked for after every chunk (one sync each), and what was decoded past it is dropped."""

    check_every = 16

    def __init__(self, model, step, cache, capacity: int):
        import torch

        device = model.tok_emb.weight.device
        self.model, self.step, self.cache = model, step, cache
        self.token = torch.zeros((1, 1), dtype=torch.long, device=device)
        self.pos = torch.zeros((), dtype=torch.long, device=device)
        self.count = torch.zeros(1, dtype=torch.long, device=device)
        self.ids = torch.zeros(max(1, capacity), dtype=torch.long, device=device)
        # graphed_decoder replaces these with replays of the captured body (one, check_every)
        self.advance = self.body
        self.advance_chunk = self.body_chunk

    def body(self) -> None:
        logits = self.step(self.model, self.token, self.pos, self.cache)
        fused = getattr(self.step, "greedy_next", None)  # the fused decoder's one-kernel version
        if fused is not None:
            fused(logits, self.token, self.ids, self.count, self.pos)
            return
        self.token.copy_(logits[:, -1].argmax(-1, keepdim=True))
        self.ids.index_copy_(0, self.count, self.token.view(1))
        self.pos.add_(1)
        self.count.add_(1)

    def body_chunk(self) -> None:
        for _ in range(self.check_every):
            self.body()

    def run(self, logits, pos, n: int, eos_id: Optional[int]) -> List[int]:
        """n token ids (fewer when EOS comes first, EOS kept) after the prompt, whose last logits
        `logits` [1, vocab] and length `pos` the prefill gave."""
        if n - 1 > self.ids.numel():
            raise ValueError(f"{n} new tokens do not fit a greedy loop of {self.ids.numel() + 1}")
        first = logits.argmax(-1).view(1, 1)
        self.token.copy_(first)
        self.pos.copy_(pos)
        self.count.zero_()
        head = [int(first.item())]  # one sync: the prefill's token
        if head[0] == eos_id:
            return head
        done = 0  # tokens the loop has decoded
        while done < n - 1:
            chunk = min(self.check_every, n - 1 - done)
            if chunk == self.check_every:
                self.advance_chunk()
            else:
                for _ in range(chunk):
                    self.advance()
            done += chunk
            if eos_id is not None:
                at = (self.ids[:done] == eos_id).nonzero()
                if at.numel():
                    return head + self.ids[:int(at[0, 0]) + 1].tolist()
        return head + self.ids[:n - 1].tolist()


DECODERS = ("auto", "eager", "compile", "triton")


def pick_decoder(choice: str, model) -> str:
    """The decode step `--decoder` asks for: `auto` takes the fused Triton kernels wherever they
    run (a GPU, model=gpt, batch 1), else eager; an explicit `triton` they cannot serve is refused."""
    from ..models.llama import fused_decode

    reason = fused_decode.unsupported(model)
    if choice == "triton" and reason:
        raise ConfigError("--decoder", f"triton: {reason}", "--decoder compile (torch.compile) or eager")
    if choice == "auto":
        return "eager" if reason else "triton"
    return choice


def graphed_decoder(model, max_len: int, decoder: str = "triton"):
    """(a decode step, one cache of `max_len` for every prompt): `triton` is the fused kernels of
    models/llama/fused_decode.py, `compile` torch.compile of kv_cache.decode_step. On a GPU the
    step is captured in a CUDA graph over static token/position buffers and the cache (and once more
    with its argmax fed back, `replay.greedy`), and each token replays one, so no token pays Python
    or launch time (on one H200 the 1.4b takes 0.98 ms a token fused, 1.56 compiled:
    bench/reports/2026-12-03-session20-*). The fused kernels' tiles are re-picked as the graph
    runs them first (decode_tuning.py)."""
    import torch

    from ..models.llama.fused_decode import FusedDecoder
    from ..models.llama.kv_cache import KVCache, decode_step

    cache = KVCache.for_model(model, 1, max_len)
    # No cudagraph trees (mode=reduce-overhead): the step writes the cache in place, and our own
    # capture below needs no heuristics about which inputs stay put.
    step = FusedDecoder(model, cache) if decoder == "triton" else torch.compile(decode_step, fullgraph=True)
    device = model.tok_emb.weight.device
    if device.type != "cuda":
        return step, cache
    token = torch.zeros((1, 1), dtype=torch.long, device=device)
    pos = torch.zeros((), dtype=torch.long, device=device)
    greedy = GreedyLoop(model, step, cache, max_len)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(3):  # compile and warm up (autotuning, cuBLAS workspaces) before capturing
            step(model, token, pos, cache)
        greedy.body()
    torch.cuda.current_stream(device).wait_stream(side)
    if decoder == "triton":  # the tiles as the graph runs them, timed mid-cache (the cache is not in use yet)
        pos.fill_(max_len // 2)
        with torch.inference_mode():
            step.tiles = step.tune(model, token, pos, cache)
        pos.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        logits = step(model, token, pos, cache)
    # The same step with its argmax fed back (GreedyLoop.body), alone and check_every of them in a
    # row: a chunk's tokens follow each other inside one graph, with no graph launch between them.
    one, chunk = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(one), torch.inference_mode():
        greedy.body()
    with torch.cuda.graph(chunk), torch.inference_mode():
        greedy.body_chunk()
    greedy.advance, greedy.advance_chunk = one.replay, chunk.replay

    def replay(_model, input_ids, position, _cache):
        token.copy_(input_ids)
        pos.copy_(position)
        graph.replay()
        return logits

    replay.step = step  # the graphs read and write the fused step's own buffers: they live as long as it
    replay.greedy = greedy  # generate_gpt's greedy decoding replays this one
    return replay, cache


def generate_hf(model, prompt: List[int], *, max_new_tokens: int, eos_id: Optional[int], temperature: float,
                top_k: int, top_p: float, generator=None) -> List[int]:
    """New token ids from transformers' `generate` (its own KV cache), batch 1. A whole
    GenerationConfig, so the model's own generation_config.json (a sampling default) does not apply."""
    import torch
    from transformers import GenerationConfig

    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    sampling = dict(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p) if temperature > 0 else {}
    config = GenerationConfig(max_new_tokens=max_new_tokens, min_new_tokens=0 if eos_id is not None else max_new_tokens,
                              eos_token_id=eos_id, pad_token_id=eos_id if eos_id is not None else 0, use_cache=True,
                              **sampling)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt):].tolist()


def _prompts(args) -> List[str]:
    if args.prompt is not None:
        return [args.prompt]
    try:
        with open(args.prompts, encoding="utf-8") as f:
            lines = [line.rstrip("\n") for line in f]
    except OSError as exc:
        raise ConfigError("--prompts", f"cannot read {args.prompts} ({exc.strerror})") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ConfigError("--prompts", f"{args.prompts} holds no prompt (one per line)")
    return prompts


def _check(args) -> None:
    if args.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens", f"must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise ConfigError("--temperature", f"must be >= 0 (0: greedy), got {args.temperature}")
    if args.top_k < 0:
        raise ConfigError("--top-k", f"must be >= 0 (0: off), got {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise ConfigError("--top-p", f"must be in (0, 1] (1: off), got {args.top_p}")
    if args.temperature == 0 and (args.top_k or args.top_p < 1):
        raise ConfigError("--temperature", "0 decodes greedily, so --top-k/--top-p would do nothing",
                          "a temperature > 0 with them")


def run(args) -> int:
    import torch

    from ..models.llama import kv_cache
    from . import plain_model, run_tokenizer

    _check(args)
    prompts = _prompts(args)
    device = plain_model.pick_device(args.device)
    dtype = plain_model.pick_dtype(args.dtype, device)
    # The tokenizer first: a run whose tokenizer cannot be found is refused before its weights load.
    hf_dir = Path(args.run).expanduser().absolute() if plain_model.is_hf_dir(args.run) else None
    codec = run_tokenizer.for_run({} if hf_dir else _run_config(args), hf_dir, args.tokenizer)
    encoded = [_encode(codec, text, args.chat) for text in prompts]
    pm = plain_model.load(args.run, step=args.step, device=device, dtype=dtype, prog=PROG)
    if kv_cache.supports(pm.model):
        generate, vocab = generate_gpt, pm.model.dims.vocab_size
    elif callable(getattr(pm.model, "generate", None)):  # a transformers model
        generate, vocab = generate_hf, pm.model.get_input_embeddings().num_embeddings
    else:
        raise ConfigError("RUN", f"model={pm.family} has no generation path here", "a model=gpt or model=hf run, "
                          "or a Hugging Face directory (mfsdp-export --format hf)")
    if args.decoder not in ("auto", "eager") and generate is not generate_gpt:
        raise ConfigError("--decoder", f"{args.decoder} is a model=gpt decode step; a transformers model decodes "
                          "with its own generate", "--decoder auto")
    decoder = pick_decoder(args.decoder, pm.model) if generate is generate_gpt else "eager"
    eos = None if args.ignore_eos else codec.eos_id
    gen = torch.Generator(device=device).manual_seed(args.seed)
    top = max(max(ids) for ids in encoded)
    if top >= vocab:
        raise ConfigError("--tokenizer", f"{codec.name} gives id {top}, outside the model's vocab of {vocab}")
    extra = {}
    if decoder != "eager":  # built, compiled and warmed up (untimed) before the first prompt
        step, cache = graphed_decoder(pm.model, max(map(len, encoded)) + args.max_new_tokens, decoder)
        extra = {"step": step, "cache": cache}
        with torch.inference_mode():
            generate_gpt(pm.model, encoded[0], max_new_tokens=4, eos_id=None, **extra)
    where = f"step {pm.step} of {args.run}" if pm.step is not None else str(args.run)
    for text, ids in zip(prompts, encoded):
        _sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            new = generate(pm.model, ids, max_new_tokens=args.max_new_tokens, eos_id=eos, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, generator=gen, **extra)
        _sync(device)
        seconds = time.perf_counter() - t0
        rate = len(new) / seconds if seconds > 0 else float("inf")
        completion = codec.decode(new)
        if args.json:
            print(json.dumps({"prompt": text, "prompt_ids": ids, "ids": new, "completion": completion,
                              "new_tokens": len(new), "seconds": round(seconds, 4), "tokens_per_s": round(rate, 1),
                              "source": str(pm.source), "step": pm.step, "decoder": decoder}), flush=True)
        else:
            print(completion if args.chat else text + completion, flush=True)
            print(f"{PROG}: {len(new)} new tokens in {seconds:.2f} s ({rate:,.1f} tokens/s; {len(ids)}-token prompt; "
                  f"{where}; {device.type} {str(dtype).replace('torch.', '')}; {decoder} decoder)", flush=True)
    return 0


def _encode(codec, text: str, chat: bool) -> List[int]:
    ids = codec.chat(text) if chat else codec.encode(text)
    if not ids:
        raise ConfigError("--prompt", f"{text!r} encodes to no tokens")
    return ids


def _run_config(args) -> dict:
    """The run's config from the manifest of the checkpoint that will load (cheap: no tensors)."""
    from ..checkpoint import resolve_checkpoint
    from .plain_model import step_dir

    found = resolve_checkpoint(step_dir(args.run, args.step), key="RUN")
    return found.manifest.get("config") or {}


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description="Generate text from a run's checkpoint or a Hugging Face directory.")
    p.add_argument("run", metavar="RUN_OR_DIR", help="run dir, checkpoints/ or step_<N> dir, or an HF directory")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt")
    src.add_argument("--prompts", metavar="FILE", help="a file of prompts, one per line")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest ids (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample within this probability mass (1: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest intact one)")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json, or a directory with tokenizer_config.json")
    p.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to each prompt")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--device", default="auto", help="auto (a GPU if there is one) | cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on a GPU, else fp32) | fp32 | bf16 | fp16")
    p.add_argument("--decoder", choices=DECODERS, default="auto",
                   help="model=gpt's decode step: triton (fused kernels; a GPU), compile (torch.compile), eager; "
                        "on a GPU the first two replay one CUDA graph. auto: triton where it runs, else eager")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = parser().parse_args(argv)
    return run_tool(PROG, lambda: run(args))


if __name__ == "__main__":
    sys.exit(main())
