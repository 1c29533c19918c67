"""Triton kernels of the batch-1 decode step (models/llama/fused_decode.py launches them).

Decoding one token reads every weight once, so a step is as fast as its matrix-vector products
stream weights and as slow as its small kernels are many. Each kernel here is one GEMV with its
neighbours folded in, so a layer takes five launches instead of ~14:

    qkv_rope_cache : RMSNorm(x) -> wqkv -> RoPE on q and k -> q out, k and v into the cache at pos
    attention      : flash-decoding over slices of the cache up to pos, the slices merged in-kernel
    gemv           : [RMSNorm(x) ->] W x [+ residual, in place]   (wo, w_down, the head)
    swiglu         : RMSNorm(x) -> w_gate_up -> silu(gate) * up

Roundings follow the eager module (gpt_modules.py): the norm's, each projection's and RoPE's
outputs are rounded to the weights' dtype, sums are fp32. `pos` is read from device memory, so one
CUDA graph serves every position.

Under PDL (programmatic dependent launch, Hopper and later) each kernel is launched while the one
before it finishes: it first requests what the previous kernel does not write (its first EARLY
weight blocks, 1 or 2; attention its cache rows before `pos`), then waits for that kernel
(`gdc_wait`). Every kernel waits before it ends, so a kernel done means all before it done:
past the wait, whatever any earlier kernel wrote is visible. Before the wait a kernel reads only
what none of its token's kernels writes (greedy_next, a plain launch, ends each token's chain).
When the next kernel may launch is the PDL constexpr: AFTER_WAIT (1) once this one's wait is
over, AT_START (2) as soon as this one starts (the next one's early loads then overlap this one's
wait too); 0 is no PDL.
"""

from __future__ import annotations

import inspect
import os

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: callers pass PDL=NO_PDL
    gdc_launch_dependents = gdc_wait = None

NO_PDL, AFTER_WAIT, AT_START = 0, 1, 2  # the kernels' PDL constexpr (the module doc)

# (rows per program, K-block, warps, pipeline stages) timed per weight shape at the first launch; a
# captured graph replays the winner. A GEMV streams its weights, so what a tile decides is how many
# bytes each program has in flight (R x BLOCK_K) against how many programs there are: a 2048-row
# projection split 32 rows a program leaves half of an H200's 132 SMs idle (session 18: with only
# such tiles wo, w_down and the head streamed at 1.6 TB/s, with these at 2.7), so the wide tiles of
# few rows are there for the short matrices. The paired kernels take rows two by two (a RoPE pair,
# a gate and its up row): B = R / 2.
_TILES = [(8, 256, 4, 3), (4, 512, 4, 3), (8, 512, 4, 3), (16, 256, 4, 3), (16, 512, 8, 3), (32, 256, 8, 3),
          (4, 1024, 4, 2), (8, 1024, 4, 2), (8, 1024, 8, 2), (16, 1024, 8, 2), (4, 2048, 4, 2), (4, 2048, 8, 2),
          (8, 2048, 8, 2), (2, 2048, 4, 2), (2, 4096, 8, 2), (4, 4096, 8, 2)]
if os.environ.get("TRITON_INTERPRET") == "1":  # no GPU to time tiles on: one, whose K blocks the CPU
    # test's dims take both ways (whole blocks and a masked last one), two or more a row
    _TILES = [(8, 128, 4, 3)]
# Where the installed Triton can, a shape's timings are kept in its cache dir, so only the first
# process that decodes a shape pays the ~26 s of timing 16 tiles for five kernels.
_KEEP = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
_GEMV_CONFIGS = [triton.Config({"R": r, "BLOCK_K": k}, num_warps=w, num_stages=s) for r, k, w, s in _TILES]
_PAIRED_CONFIGS = [triton.Config({"B": r // 2, "BLOCK_K": k}, num_warps=w, num_stages=s)
                   for r, k, w, s in _TILES if r >= 4]


def _even_k(args) -> bool:
    return args["K"] % args["BLOCK_K"] == 0


def _x_block(args) -> int:
    """The elements of x that `_inv_rms` loads at once: all of them up to 8192, so that the norm,
    which every NORM kernel computes right after its wait, costs one load's latency, not K / BLOCK_K."""
    return min(triton.next_power_of_2(args["K"]), 8192)


@triton.jit
def _inv_rms(x_ptr, K, eps, X_BLOCK: tl.constexpr):
    acc = tl.zeros([X_BLOCK], tl.float32)
    for k0 in range(0, K, X_BLOCK):
        cols = k0 + tl.arange(0, X_BLOCK)
        v = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        acc += v * v
    return tl.rsqrt(tl.sum(acc, 0) / K + eps)


@triton.jit
def _on_start(PDL: tl.constexpr):
    """A kernel's first statement: under AT_START, lets the next kernel launch now."""
    if PDL == 2:
        gdc_launch_dependents()


@triton.jit
def _after_previous_kernel(PDL: tl.constexpr):
    """Wait for the previous kernel's writes; under AFTER_WAIT, then let the next kernel launch."""
    if PDL > 0:
        gdc_wait()
    if PDL == 1:
        gdc_launch_dependents()


@triton.jit
def _weights(w_ptr, rows, row_ok, k0, K, EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [R, BLOCK_K] block of W at column k0 (zeros past K: the prefetch past the last block)."""
    cols = k0 + tl.arange(0, BLOCK_K)
    if EVEN_K:  # k0 < K holds for the whole block or for none of it: a mask constant along the
        # columns keeps the 128-bit loads that a per-column mask would split
        in_k = (tl.zeros([1, BLOCK_K], tl.int32) + k0) < K
    else:
        in_k = (cols < K)[None, :]
    return tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=row_ok[:, None] & in_k, other=0.0,
                   eviction_policy="evict_first")


@triton.jit
def _dot_rows(w_ptr, x_ptr, g_ptr, eps, rows, row_ok, K, NORM: tl.constexpr, EVEN_K: tl.constexpr,
              PDL: tl.constexpr, EARLY: tl.constexpr, X_BLOCK: tl.constexpr, R: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """fp32 sums of W[rows, :] * x' ([R]), x' = RMSNorm(x; g) rounded (NORM) or x. The first EARLY
    (1 or 2) weight blocks are requested before waiting on the kernel that wrote x; then each block
    EARLY ahead while the current one is summed."""
    _on_start(PDL)
    rows = rows.to(tl.int64)  # rows * K passes 2**31 for big heads
    w = _weights(w_ptr, rows, row_ok, 0, K, EVEN_K, BLOCK_K)
    if EARLY == 2:
        w_second = _weights(w_ptr, rows, row_ok, BLOCK_K, K, EVEN_K, BLOCK_K)
    _after_previous_kernel(PDL)
    if NORM:
        inv_rms = _inv_rms(x_ptr, K, eps, X_BLOCK)
    else:
        inv_rms = 1.0
    acc = tl.zeros([R, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w_next = _weights(w_ptr, rows, row_ok, k0 + EARLY * BLOCK_K, K, EVEN_K, BLOCK_K)
        cols = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_ptr + cols)
        else:
            x = tl.load(x_ptr + cols, mask=cols < K, other=0.0)
        if NORM:
            g = tl.load(g_ptr + cols, mask=cols < K, other=0.0)
            x = (x.to(tl.float32) * inv_rms * g.to(tl.float32)).to(x_ptr.dtype.element_ty)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        if EARLY == 2:
            w, w_second = w_second, w_next
        else:
            w = w_next
    return tl.sum(acc, 1)


@triton.autotune(configs=_GEMV_CONFIGS, key=["N", "K", "NORM", "RESIDUAL"], restore_value=["out_ptr"], **_KEEP)
@triton.heuristics({"EVEN_K": _even_k, "X_BLOCK": _x_block})
@triton.jit
def gemv(x_ptr, g_ptr, w_ptr, out_ptr, N, K, eps, NORM: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr,
         EARLY: tl.constexpr, EVEN_K: tl.constexpr, X_BLOCK: tl.constexpr, R: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[N] = W[N, K] @ x' (x' = RMSNorm(x; g) under NORM), plus out's own values under RESIDUAL."""
    rows = tl.program_id(0) * R + tl.arange(0, R)
    row_ok = rows < N
    y = _dot_rows(w_ptr, x_ptr, g_ptr, eps, rows, row_ok, K, NORM, EVEN_K, PDL, EARLY, X_BLOCK, R, BLOCK_K)
    y = y.to(out_ptr.dtype.element_ty)
    if RESIDUAL:
        y = (tl.load(out_ptr + rows, mask=row_ok, other=0.0).to(tl.float32) + y.to(tl.float32)).to(y.dtype)
    tl.store(out_ptr + rows, y, mask=row_ok)


@triton.autotune(configs=_PAIRED_CONFIGS, key=["N", "K"], **_KEEP)
@triton.heuristics({"EVEN_K": _even_k, "X_BLOCK": _x_block})
@triton.jit
def swiglu(x_ptr, g_ptr, w_ptr, out_ptr, N, K, eps, PDL: tl.constexpr, EARLY: tl.constexpr, EVEN_K: tl.constexpr,
           X_BLOCK: tl.constexpr, B: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[N] = silu(gate) * up of W = [gate; up] ([2N, K]) @ RMSNorm(x; g)."""
    pair = tl.arange(0, 2 * B)
    first = tl.program_id(0) * B
    rows = first + pair // 2 + (pair % 2) * N  # gate row j beside up row N + j
    row_ok = first + pair // 2 < N
    y = _dot_rows(w_ptr, x_ptr, g_ptr, eps, rows, row_ok, K, True, EVEN_K, PDL, EARLY, X_BLOCK, 2 * B, BLOCK_K)
    gate, up = tl.split(tl.reshape(y.to(out_ptr.dtype.element_ty).to(tl.float32), (B, 2)))
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    j = first + tl.arange(0, B)
    tl.store(out_ptr + j, (act * up).to(out_ptr.dtype.element_ty), mask=j < N)


@triton.autotune(configs=_PAIRED_CONFIGS, key=["K", "N_HEADS", "N_KV", "HEAD_DIM"], **_KEEP)
@triton.heuristics({"EVEN_K": _even_k, "X_BLOCK": _x_block})
@triton.jit
def qkv_rope_cache(x_ptr, g_ptr, w_ptr, inv_freq_ptr, pos_ptr, q_ptr, k_cache_ptr, v_cache_ptr, K, eps, cache_len,
                   N_HEADS: tl.constexpr, N_KV: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr,
                   EARLY: tl.constexpr, EVEN_K: tl.constexpr, X_BLOCK: tl.constexpr, B: tl.constexpr,
                   BLOCK_K: tl.constexpr):
    """wqkv @ RMSNorm(x; g): q heads rotated into q_ptr, the kv heads' k (rotated) and v into row
    `pos` of the caches ([N_KV, cache_len, HEAD_DIM] each). A program owns B rotation pairs of a head."""
    HALF: tl.constexpr = HEAD_DIM // 2
    per_head = tl.cdiv(HALF, B)
    head = tl.program_id(0) // per_head
    i = (tl.program_id(0) % per_head) * B + tl.arange(0, B)  # the pairs' index in the first half
    pair = tl.arange(0, 2 * B)
    in_half = (tl.program_id(0) % per_head) * B + pair // 2
    rows = head * HEAD_DIM + in_half + (pair % 2) * HALF
    y = _dot_rows(w_ptr, x_ptr, g_ptr, eps, rows, in_half < HALF, K, True, EVEN_K, PDL, EARLY, X_BLOCK, 2 * B,
                  BLOCK_K)
    lo, hi = tl.split(tl.reshape(y.to(q_ptr.dtype.element_ty).to(tl.float32), (B, 2)))
    pos = tl.load(pos_ptr)
    if head < N_HEADS + N_KV:  # q and k turn by the position's angles ("rotate half", as apply_rope)
        angle = pos.to(tl.float32) * tl.load(inv_freq_ptr + i, mask=i < HALF, other=0.0)
        cos, sin = tl.cos(angle), tl.sin(angle)
        lo, hi = lo * cos - hi * sin, hi * cos + lo * sin
    if head < N_HEADS:
        dst = q_ptr + head * HEAD_DIM
    elif head < N_HEADS + N_KV:
        dst = k_cache_ptr + ((head - N_HEADS) * cache_len + pos) * HEAD_DIM
    else:
        dst = v_cache_ptr + ((head - N_HEADS - N_KV) * cache_len + pos) * HEAD_DIM
    tl.store(dst + i, lo.to(q_ptr.dtype.element_ty), mask=i < HALF)
    tl.store(dst + HALF + i, hi.to(q_ptr.dtype.element_ty), mask=i < HALF)


@triton.jit
def attention(q_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, m_ptr, l_ptr, acc_ptr, done_ptr, out_ptr, cache_len, scale,
              GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, BLOCK_L: tl.constexpr,
              PDL: tl.constexpr):
    """Flash-decoding: program (head, split) computes the softmax partials (running max, sum,
    weighted values) of one query head over one slice of cache positions 0..pos (the slices split
    the valid length, so no program reads past pos); the last of a head's programs to finish merges
    them into the head's output, so attention is one launch. The slice's first K/V tile is read
    before waiting on qkv_rope_cache, all but row `pos`, which that kernel writes."""
    _on_start(PDL)
    head, split = tl.program_id(0), tl.program_id(1)
    pos = tl.load(pos_ptr)
    n = pos + 1
    chunk = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_L) * BLOCK_L
    start = split * chunk
    end = tl.minimum(start + chunk, n)
    d = tl.arange(0, HEAD_DIM)
    kv = (head // GROUP) * cache_len * HEAD_DIM
    at = start + tl.arange(0, BLOCK_L)
    old = (at < end) & (at < pos)
    k = tl.load(k_cache_ptr + kv + at[:, None] * HEAD_DIM + d[None, :], mask=old[:, None], other=0.0)
    v = tl.load(v_cache_ptr + kv + at[:, None] * HEAD_DIM + d[None, :], mask=old[:, None], other=0.0)
    _after_previous_kernel(PDL)
    q = tl.load(q_ptr + head * HEAD_DIM + d)  # requested before the new row's loads, so the two overlap
    if end == n:  # this slice holds the new row: read it now that it is written
        new = (at == pos)[:, None]
        k = tl.where(new, tl.load(k_cache_ptr + kv + at[:, None] * HEAD_DIM + d[None, :], mask=new, other=0.0), k)
        v = tl.where(new, tl.load(v_cache_ptr + kv + at[:, None] * HEAD_DIM + d[None, :], mask=new, other=0.0), v)
    q = q.to(tl.float32) * scale
    m = tl.full([], -1e30, tl.float32)  # finite, so an empty slice merges with weight exp(-huge) = 0
    total = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for l0 in range(start, end, BLOCK_L):
        at = l0 + tl.arange(0, BLOCK_L)
        ok = at < end
        if l0 > start:  # the first tile is in k and v already; the later ones are read after the wait
            k = tl.load(k_cache_ptr + kv + at[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)
            v = tl.load(v_cache_ptr + kv + at[:, None] * HEAD_DIM + d[None, :], mask=ok[:, None], other=0.0)
        s = tl.where(ok, tl.sum(k.to(tl.float32) * q[None, :], 1), float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        p = tl.exp(s - m_new)
        keep = tl.exp(m - m_new)
        acc = acc * keep + tl.sum(p[:, None] * v.to(tl.float32), 0)
        total = total * keep + tl.sum(p, 0)
        m = m_new
    slot = head * SPLITS + split
    tl.store(m_ptr + slot, m)
    tl.store(l_ptr + slot, total)
    tl.store(acc_ptr + slot * HEAD_DIM + d, acc)
    # Every thread's partials are written before one thread counts this program in (the release of
    # the count publishes them, as in CUDA's threadfence reduction); the last one's loads skip L1,
    # which may hold another step's partials.
    tl.debug_barrier()
    if tl.atomic_add(done_ptr + head, 1, sem="acq_rel") == SPLITS - 1:
        slots = head * SPLITS + tl.arange(0, SPLITS)
        ms = tl.load(m_ptr + slots, cache_modifier=".cg")
        weight = tl.exp(ms - tl.max(ms, 0))
        accs = tl.load(acc_ptr + slots[:, None] * HEAD_DIM + d[None, :], cache_modifier=".cg")
        out = tl.sum(accs * weight[:, None], 0) / tl.sum(tl.load(l_ptr + slots, cache_modifier=".cg") * weight, 0)
        tl.store(out_ptr + head * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty))
        tl.store(done_ptr + head, 0)  # ready for the next layer's launch


@triton.jit
def greedy_next(logits_ptr, token_ptr, pos_ptr, ids_ptr, count_ptr, V, BLOCK: tl.constexpr):
    """A greedy token's bookkeeping in one program: token = argmax(logits) (the first of equal
    maxima, as torch.argmax), ids[count] = token, then pos and count + 1 (tools/generate.py
    GreedyLoop). Launched without PDL: the next token's kernels, whose early loads read pos and
    the cache, start after it and after every kernel of this token."""
    best = tl.full([], float("-inf"), tl.float32)
    best_at = tl.full([], 0, tl.int64)
    for v0 in range(0, V, BLOCK):
        at = v0 + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + at, mask=at < V, other=float("-inf")).to(tl.float32)
        top = tl.max(x, 0)
        first = tl.argmax(x, 0, tie_break_left=True).to(tl.int64) + v0
        better = top > best  # strictly: on a tie the earlier block's index stays
        best_at = tl.where(better, first, best_at)
        best = tl.where(better, top, best)
    count = tl.load(count_ptr)
    tl.store(token_ptr, best_at)
    tl.store(ids_ptr + count, best_at)
    tl.store(count_ptr, count + 1)
    tl.store(pos_ptr, tl.load(pos_ptr) + 1)
