"""Context-parallel (CP) attention in plain torch: a reference workload for cpq.

Why this exists: cpq's whole point is running many short distributed cases in warm
torchrun groups, and the suite it was built for is Transformer Engine's context-parallel
attention matrix. This module reproduces that workload without TE so the tests and
benchmarks have something real to run: every case does genuine collectives (all-gather,
reduce-scatter, ring send/recv, all-to-all) with autograd flowing through them, and
checks the result the way TE's ``run_dpa_with_cp`` does:

* every rank builds the full Q, K, V and dout from one seed and computes plain (non-CP)
  attention forward and backward as the reference;
* the sequence is split load-balanced for causal masks (2*ws chunks, rank r keeps chunks
  r and 2*ws-1-r) and one CP scheme runs forward and backward on the local shards;
* out, dq, dk, dv are gathered back to full order and compared with dtype tolerances.

Calling convention (cpq task): ``run_cp_attention(**kwargs)`` runs on every rank of an
initialised process group, raises AssertionError on mismatch, ``pytest.skip`` when a case
cannot run at this world size, and returns a small msgpack-able dict.

The local attention kernel is deliberately simple (fp32 matmul + softmax, chunked over
query rows so GPU sizes fit) but returns the log-sum-exp, so partial results over key
blocks can be merged exactly (online softmax) and backward can be recomputed blockwise
flash-attention style from the final output and LSE.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist

__all__ = [
    "CASES",
    "GPU_CASES",
    "case_id",
    "gather_load_balanced",
    "load_balanced_positions",
    "run_cp_attention",
    "split_load_balanced",
]

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
# (atol, rtol) per dtype, as in TE's CP tests: loose for bf16, tighter for fp16, and
# fp32 tight enough that a wrong mask, a missing rescale or a lost gradient fails.
TOLERANCES: dict[str, tuple[float, float]] = {
    "fp32": (5e-5, 1e-4),
    "bf16": (2.5e-2, 2.5e-2),
    "fp16": (5e-3, 1e-2),
}
CP_COMM_TYPES = ("all_gather", "p2p", "a2a")
QKV_FORMATS = ("bshd", "sbhd")
ATTN_MASKS = ("causal", "no_mask")

# Upper bound on elements of one fp32 score block [b, h, rows, keys] in the local kernel;
# a few temporaries of this size exist at once, so this caps kernel memory at a few GiB.
_SCORE_BLOCK_ELEMS = 1 << 28


def _skip(reason: str) -> NoReturn:
    """Skip the case the pytest way (cpq maps pytest's Skipped to outcome "skipped")."""
    import pytest

    pytest.skip(reason)
    raise AssertionError("unreachable")  # pytest.skip raises; keeps type checkers happy


# --------------------------------------------------------------------------------------
# Load-balanced sequence split
# --------------------------------------------------------------------------------------


def split_load_balanced(x: torch.Tensor, rank: int, world_size: int, seq_dim: int) -> torch.Tensor:
    """Return rank's shard: chunks ``rank`` and ``2*ws-1-rank`` of 2*ws along seq_dim.

    Pairing an early chunk with a late one gives every rank the same amount of causal work.
    """
    n = 2 * world_size
    if x.shape[seq_dim] % n:
        raise ValueError(f"seq len {x.shape[seq_dim]} not divisible by 2*world_size={n}")
    chunks = x.chunk(n, dim=seq_dim)
    return torch.cat([chunks[rank], chunks[n - 1 - rank]], dim=seq_dim)


def gather_load_balanced(parts: Sequence[torch.Tensor], seq_dim: int) -> torch.Tensor:
    """Inverse of :func:`split_load_balanced`: per-rank shards (rank order) -> full sequence."""
    ws = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * ws)
    for r, part in enumerate(parts):
        first, second = part.chunk(2, dim=seq_dim)
        chunks[r] = first
        chunks[2 * ws - 1 - r] = second
    return torch.cat([c for c in chunks if c is not None], dim=seq_dim)


def load_balanced_positions(
    rank: int, world_size: int, seqlen: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Global token positions held by ``rank`` under the load-balanced split."""
    c = seqlen // (2 * world_size)
    lo = torch.arange(rank * c, (rank + 1) * c, device=device)
    hi = torch.arange((2 * world_size - 1 - rank) * c, (2 * world_size - rank) * c, device=device)
    return torch.cat([lo, hi])


def _seq_dim(qkv_format: str) -> int:
    return 1 if qkv_format == "bshd" else 0


def _to_bhsd(x: torch.Tensor, qkv_format: str) -> torch.Tensor:
    return x.permute(0, 2, 1, 3) if qkv_format == "bshd" else x.permute(1, 2, 0, 3)


def _from_bhsd(x: torch.Tensor, qkv_format: str) -> torch.Tensor:
    return x.permute(0, 2, 1, 3) if qkv_format == "bshd" else x.permute(2, 0, 1, 3)


# --------------------------------------------------------------------------------------
# Local attention kernel with LSE (all tensors [b, h, s, d]; math in fp32)
# --------------------------------------------------------------------------------------


def _row_block(b: int, h: int, sk: int) -> int:
    return max(1, _SCORE_BLOCK_ELEMS // max(1, b * h * sk))


def _scores(
    qb: torch.Tensor,
    kf: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    causal: bool,
    scale: float,
) -> torch.Tensor:
    s = torch.matmul(qb.float(), kf.transpose(-1, -2)) * scale
    if causal:
        s.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
    return s


def _attn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q against one key block; returns (out fp32, lse fp32 [b,h,sq]).

    Rows whose keys are all masked get lse=-inf and out=0, which the LSE merge treats as
    "no contribution" — needed because in p2p a whole KV block can lie in the future.
    """
    b, h, sq, _ = q.shape
    g = h // k.shape[1]
    kf = k.float().repeat_interleave(g, dim=1)
    vf = v.float().repeat_interleave(g, dim=1)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    step = _row_block(b, h, k.shape[2])
    for i in range(0, sq, step):
        s = _scores(q[:, :, i : i + step], kf, q_pos[i : i + step], k_pos, causal, scale)
        m = torch.logsumexp(s, dim=-1)
        m_safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m_safe[..., None])
        out[:, :, i : i + step] = torch.matmul(p, vf)
        lse[:, :, i : i + step] = m
    return out, lse


def _attn_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dout: torch.Tensor,
    delta: torch.Tensor,
    lse: torch.Tensor,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flash-attention style backward of one key block, recomputing P from the final LSE.

    ``lse`` and ``delta = rowsum(dout * out)`` are those of the *complete* attention row,
    so P here is the true probability restricted to this block and the block gradients add
    up exactly. Returns fp32 (dq, dk, dv); dk/dv are summed back over GQA groups.
    """
    b, h, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    g = h // hkv
    kf = k.float().repeat_interleave(g, dim=1)
    vf = v.float().repeat_interleave(g, dim=1)
    dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros((b, h, sk, d), dtype=torch.float32, device=q.device)
    dv = torch.zeros((b, h, sk, d), dtype=torch.float32, device=q.device)
    lse_safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    step = _row_block(b, h, sk)
    for i in range(0, sq, step):
        sl = slice(i, i + step)
        qb = q[:, :, sl].float()
        dob = dout[:, :, sl].float()
        p = torch.exp(_scores(qb, kf, q_pos[sl], k_pos, causal, scale) - lse_safe[:, :, sl, None])
        dv += torch.matmul(p.transpose(-1, -2), dob)
        ds = p * (torch.matmul(dob, vf.transpose(-1, -2)) - delta[:, :, sl, None])
        dq[:, :, sl] = torch.matmul(ds, kf) * scale
        dk += torch.matmul(ds.transpose(-1, -2), qb) * scale
    if g > 1:
        dk = dk.view(b, hkv, g, sk, d).sum(2)
        dv = dv.view(b, hkv, g, sk, d).sum(2)
    return dq, dk, dv


class _Attention(torch.autograd.Function):
    """Local attention with position-based causal mask; backward via :func:`_attn_bwd`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_pos: torch.Tensor,
        k_pos: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> torch.Tensor:
        out, lse = _attn_fwd(q, k, v, q_pos, k_pos, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse, q_pos, k_pos)
        ctx.causal, ctx.scale = causal, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, out, lse, q_pos, k_pos = ctx.saved_tensors
        delta = (dout.float() * out).sum(-1)
        dq, dk, dv = _attn_bwd(q, k, v, dout, delta, lse, q_pos, k_pos, ctx.causal, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


# --------------------------------------------------------------------------------------
# Scheme 1: all_gather (K/V all-gathered, grads reduce-scattered)
# --------------------------------------------------------------------------------------


class _AllGatherSeq(torch.autograd.Function):
    """All-gather a load-balanced shard into the full sequence; backward reduce-scatters.

    ``broken`` drops the cross-rank reduction in backward (each rank keeps only its own
    contribution to its K/V gradient) — the classic missing-reduce bug.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, seq_dim: int, broken: bool
    ) -> torch.Tensor:
        ws = dist.get_world_size()
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(ws)]
        dist.all_gather(parts, x.contiguous())
        ctx.seq_dim, ctx.broken = seq_dim, broken
        return gather_load_balanced(parts, seq_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        rank, ws = dist.get_rank(), dist.get_world_size()
        shards = [split_load_balanced(grad, r, ws, ctx.seq_dim).contiguous() for r in range(ws)]
        if ctx.broken:
            return shards[rank], None, None
        if dist.get_backend() == "nccl":
            out = torch.empty_like(shards[rank])
            dist.reduce_scatter(out, shards)
        else:
            # gloo lacks reduce_scatter on older torch; all-reduce + take ours is equivalent.
            full = torch.stack(shards)
            dist.all_reduce(full)
            out = full[rank]
        return out, None, None


def _cp_all_gather(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str, causal: bool, broken: bool
) -> torch.Tensor:
    rank, ws = dist.get_rank(), dist.get_world_size()
    sd = _seq_dim(fmt)
    seqlen = q.shape[sd] * ws
    k_full = _AllGatherSeq.apply(k, sd, broken)
    v_full = _AllGatherSeq.apply(v, sd, broken)
    q_pos = load_balanced_positions(rank, ws, seqlen, q.device)
    k_pos = torch.arange(seqlen, device=q.device)
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = _Attention.apply(
        _to_bhsd(q, fmt), _to_bhsd(k_full, fmt), _to_bhsd(v_full, fmt), q_pos, k_pos, causal, scale
    )
    return _from_bhsd(out, fmt)


# --------------------------------------------------------------------------------------
# Scheme 2: p2p ring with online-softmax merge
# --------------------------------------------------------------------------------------


def _ring_start(
    tensors: Sequence[torch.Tensor], rank: int, ws: int
) -> tuple[list[Any], list[torch.Tensor]]:
    """Post send-to-next / recv-from-prev for each tensor; returns (requests, recv buffers)."""
    bufs = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, (rank + 1) % ws) for t in tensors]
    ops += [dist.P2POp(dist.irecv, b, (rank - 1) % ws) for b in bufs]
    return dist.batch_isend_irecv(ops), bufs


def _ring_finish(reqs: Sequence[Any]) -> None:
    for r in reqs:
        r.wait()


def _lse_merge(
    out: torch.Tensor, lse: torch.Tensor, o_i: torch.Tensor, l_i: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial softmax results: rescale each by exp(lse_part - lse_total)."""
    new = torch.logaddexp(lse, l_i)
    new_safe = torch.where(torch.isinf(new), torch.zeros_like(new), new)
    out = out * torch.exp(lse - new_safe)[..., None] + o_i * torch.exp(l_i - new_safe)[..., None]
    return out, new


class _RingAttention(torch.autograd.Function):
    """Ring attention: K/V blocks travel around the ring while Q stays put.

    Forward overlaps the next block's send/recv with the current block's compute and merges
    partials by LSE. Backward runs the ring again: dq accumulates locally, dk/dv travel with
    their K/V block and arrive back at the owner after ws hops. ``broken`` skips the LSE
    rescale (just sums normalised partials), which is wrong whenever ws > 1.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        scale: float,
        broken: bool,
    ) -> torch.Tensor:
        rank, ws = dist.get_rank(), dist.get_world_size()
        seqlen = q.shape[2] * ws
        q_pos = load_balanced_positions(rank, ws, seqlen, q.device)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        for step in range(ws):
            pending = _ring_start([kv], rank, ws) if step < ws - 1 else None
            src = (rank - step) % ws
            k_pos = load_balanced_positions(src, ws, seqlen, q.device)
            o_i, l_i = _attn_fwd(q, kv[0], kv[1], q_pos, k_pos, causal, scale)
            if broken:
                out, lse = out + o_i, torch.logaddexp(lse, l_i)
            else:
                out, lse = _lse_merge(out, lse, o_i, l_i)
            if pending is not None:
                _ring_finish(pending[0])
                kv = pending[1][0]
        ctx.save_for_backward(q, k, v, out, lse, q_pos)
        ctx.causal, ctx.scale = causal, scale
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        q, k, v, out, lse, q_pos = ctx.saved_tensors
        rank, ws = dist.get_rank(), dist.get_world_size()
        seqlen = q.shape[2] * ws
        delta = (dout.float() * out).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        for step in range(ws):
            src = (rank - step) % ws
            k_pos = load_balanced_positions(src, ws, seqlen, q.device)
            dq_i, dk_i, dv_i = _attn_bwd(
                q, kv[0], kv[1], dout, delta, lse, q_pos, k_pos, ctx.causal, ctx.scale
            )
            dq += dq_i
            dkv[0] += dk_i
            dkv[1] += dv_i
            if ws > 1:
                # The last hop carries only the finished dk/dv home to their owner.
                send = [kv, dkv] if step < ws - 1 else [dkv]
                reqs, bufs = _ring_start(send, rank, ws)
                _ring_finish(reqs)
                dkv = bufs[-1]
                if step < ws - 1:
                    kv = bufs[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def _cp_p2p(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str, causal: bool, broken: bool
) -> torch.Tensor:
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = _RingAttention.apply(
        _to_bhsd(q, fmt), _to_bhsd(k, fmt), _to_bhsd(v, fmt), causal, scale, broken
    )
    return _from_bhsd(out, fmt)


# --------------------------------------------------------------------------------------
# Scheme 3: a2a (Ulysses) — sequence-split <-> head-split
# --------------------------------------------------------------------------------------


def _all_to_all(
    x: torch.Tensor, scatter_dim: int, gather_dim: int, reverse: bool = False
) -> torch.Tensor:
    """Split x along scatter_dim into ws pieces, send piece j to rank j, concat what arrives
    along gather_dim in rank order (reversed rank order if ``reverse``: the broken variant)."""
    ws = dist.get_world_size()
    send = torch.stack(x.chunk(ws, dim=scatter_dim)).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    pieces = list(recv.unbind(0))
    if reverse:
        pieces.reverse()
    return torch.cat(pieces, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """Autograd all-to-all; its gradient is the all-to-all with the dims swapped."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: torch.Tensor, scatter_dim: int, gather_dim: int, broken: bool
    ) -> torch.Tensor:
        ctx.dims = (scatter_dim, gather_dim)
        return _all_to_all(x, scatter_dim, gather_dim, reverse=broken)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, gather_dim, scatter_dim), None, None, None


def _cp_a2a(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str, causal: bool, broken: bool
) -> torch.Tensor:
    ws = dist.get_world_size()
    sd, hd = _seq_dim(fmt), 2  # heads sit at dim 2 in both bshd and sbhd
    heads, kv_heads = q.shape[hd], k.shape[hd]
    if heads % ws:
        _skip(f"a2a needs heads ({heads}) divisible by world size ({ws})")
    if kv_heads % ws:
        # GQA with fewer KV heads than ranks: repeat KV heads up to lcm(kv_heads, ws), which
        # divides heads, so each rank's Q head group still maps onto its own KV heads.
        rep = ws // math.gcd(kv_heads, ws)
        k = k.repeat_interleave(rep, dim=hd)
        v = v.repeat_interleave(rep, dim=hd)
    seqlen = q.shape[sd] * ws
    # After the a2a the sequence is rank-major: rank 0's two chunks, then rank 1's, ...
    pos = torch.cat([load_balanced_positions(r, ws, seqlen, q.device) for r in range(ws)])
    qh, kh, vh = (_AllToAll.apply(t, hd, sd, False) for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = _Attention.apply(
        _to_bhsd(qh, fmt), _to_bhsd(kh, fmt), _to_bhsd(vh, fmt), pos, pos, causal, scale
    )
    return _AllToAll.apply(_from_bhsd(out, fmt), sd, hd, broken)


_SCHEMES = {"all_gather": _cp_all_gather, "p2p": _cp_p2p, "a2a": _cp_a2a}


# --------------------------------------------------------------------------------------
# Reference, comparison and the task entry point
# --------------------------------------------------------------------------------------


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str, causal: bool
) -> torch.Tensor:
    """Plain full-sequence attention (SDPA; flash/efficient kernels on GPU, so big sizes fit).

    Independent of the CP kernel above on purpose: a bug shared by both would hide.
    """
    g = q.shape[2] // k.shape[2]
    qb, kb, vb = _to_bhsd(q, fmt), _to_bhsd(k, fmt), _to_bhsd(v, fmt)
    if g > 1:
        kb, vb = kb.repeat_interleave(g, dim=1), vb.repeat_interleave(g, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=causal)
    return _from_bhsd(out, fmt)


def _gather_full(x: torch.Tensor, seq_dim: int) -> torch.Tensor:
    parts = [
        torch.empty_like(x, memory_format=torch.contiguous_format)
        for _ in range(dist.get_world_size())
    ]
    dist.all_gather(parts, x.contiguous())
    return gather_load_balanced(parts, seq_dim)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_cp_attention(
    cp_comm_type: str = "p2p",
    qkv_format: str = "bshd",
    attn_mask: str = "causal",
    dtype: str = "fp32",
    batch: int = 2,
    seqlen: int = 64,
    heads: int = 4,
    gqa_groups: int | None = None,
    head_dim: int = 16,
    seed: int = 1234,
    broken: bool = False,
) -> dict[str, Any]:
    """Run one CP attention case on every rank and check it against plain attention.

    ``gqa_groups`` is the number of K/V heads (None = MHA). ``broken`` deliberately breaks
    the scheme (all_gather: no grad reduction; p2p: no LSE rescale; a2a: heads come back in
    the wrong rank order) so a test can prove the comparison catches a wrong scheme.
    Returns max abs errors, tolerances and timings; raises AssertionError on mismatch.
    """
    if cp_comm_type not in _SCHEMES:
        raise ValueError(f"cp_comm_type must be one of {CP_COMM_TYPES}, got {cp_comm_type!r}")
    if qkv_format not in QKV_FORMATS:
        raise ValueError(f"qkv_format must be one of {QKV_FORMATS}, got {qkv_format!r}")
    if attn_mask not in ATTN_MASKS:
        raise ValueError(f"attn_mask must be one of {ATTN_MASKS}, got {attn_mask!r}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    kv_heads = heads if gqa_groups is None else int(gqa_groups)
    if kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of gqa_groups ({kv_heads})")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised (cpq initialises it)")

    rank, ws = dist.get_rank(), dist.get_world_size()
    if seqlen % (2 * ws):
        _skip(f"seqlen {seqlen} not divisible by 2*world_size={2 * ws}")
    if cp_comm_type == "a2a" and heads % ws:
        _skip(f"a2a needs heads ({heads}) divisible by world size ({ws})")
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    dt = DTYPES[dtype]
    causal = attn_mask == "causal"
    sd = _seq_dim(qkv_format)

    # Same seed on every rank -> identical full tensors everywhere (the CUDA Philox stream
    # is device-independent, so this also holds across GPUs).
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)

    def shape(h: int) -> tuple[int, ...]:
        if qkv_format == "bshd":
            return (batch, seqlen, h, head_dim)
        return (seqlen, batch, h, head_dim)

    def randn(h: int) -> torch.Tensor:
        return torch.randn(shape(h), generator=gen, device=device, dtype=torch.float32).to(dt)

    q, k, v, dout = randn(heads), randn(kv_heads), randn(kv_heads), randn(heads)

    # Reference: plain attention over the full sequence.
    _sync(device)
    t0 = time.perf_counter()
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    out_ref = _reference(qr, kr, vr, qkv_format, causal)
    out_ref.backward(dout)
    _sync(device)
    ref_s = time.perf_counter() - t0
    refs = {"out": out_ref.detach(), "dq": qr.grad, "dk": kr.grad, "dv": vr.grad}
    del qr, kr, vr, out_ref

    # CP: local load-balanced shards, one scheme forward + backward.
    ql, kl, vl = (split_load_balanced(t, rank, ws, sd).clone().requires_grad_() for t in (q, k, v))
    dout_l = split_load_balanced(dout, rank, ws, sd).contiguous()
    del q, k, v, dout
    # device_ids keeps NCCL from guessing the device (and warning about it).
    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)
    _sync(device)
    t0 = time.perf_counter()
    out_l = _SCHEMES[cp_comm_type](ql, kl, vl, qkv_format, causal, broken)
    out_l.backward(dout_l)
    _sync(device)
    cp_s = time.perf_counter() - t0

    assert ql.grad is not None and kl.grad is not None and vl.grad is not None
    got = {
        "out": _gather_full(out_l.detach(), sd),
        "dq": _gather_full(ql.grad, sd),
        "dk": _gather_full(kl.grad, sd),
        "dv": _gather_full(vl.grad, sd),
    }
    atol, rtol = TOLERANCES[dtype]
    result: dict[str, Any] = {"world_size": ws, "atol": atol, "rtol": rtol}
    bad: list[str] = []
    for name, ref in refs.items():
        assert ref is not None
        err = (got[name].float() - ref.float()).abs()
        max_err = float(err.max())
        result[f"{name}_max_abs_err"] = max_err
        if not bool((err <= atol + rtol * ref.float().abs()).all()) or math.isnan(max_err):
            bad.append(f"{name}: max abs err {max_err:.3e} exceeds atol={atol:g} rtol={rtol:g}")
    if bad:
        raise AssertionError(
            f"CP attention mismatch vs reference ({cp_comm_type}, {qkv_format}, {attn_mask}, "
            f"{dtype}, ws={ws}, rank={rank}, broken={broken}): " + "; ".join(bad)
        )
    result["cp_fwd_bwd_s"] = cp_s
    result["ref_fwd_bwd_s"] = ref_s
    return result


# --------------------------------------------------------------------------------------
# Case matrices
# --------------------------------------------------------------------------------------


def _case(
    cp: str, fmt: str, mask: str, gqa: int | None, dtype: str, **sizes: int
) -> dict[str, Any]:
    return {
        "cp_comm_type": cp,
        "qkv_format": fmt,
        "attn_mask": mask,
        "dtype": dtype,
        "gqa_groups": gqa,
        **sizes,
    }


# CPU matrix: 3 schemes x 2 layouts x 2 masks x {MHA, GQA} = 24 tiny fp32 cases (each a
# few ms on gloo). seqlen 64 splits for ws up to 32; heads 4 lets a2a run up to ws=4.
CASES: list[dict[str, Any]] = [
    _case(cp, fmt, mask, gqa, "fp32", batch=2, seqlen=64, heads=4, head_dim=16)
    for cp in CP_COMM_TYPES
    for fmt in QKV_FORMATS
    for mask in ATTN_MASKS
    for gqa in (None, 2)
]

# GPU matrix (nccl): bf16 over the full scheme/layout/mask grid with GQA on sbhd, plus
# fp16 spot checks. Sizes give tens to hundreds of ms of real work per case on an H200 and
# fit in memory at world size 1 (where CP degenerates to plain attention).
GPU_CASES: list[dict[str, Any]] = [
    _case(
        cp,
        fmt,
        mask,
        None if fmt == "bshd" else 4,
        "bf16",
        batch=2,
        seqlen=8192,
        heads=16,
        head_dim=128,
    )
    for cp in CP_COMM_TYPES
    for fmt in QKV_FORMATS
    for mask in ATTN_MASKS
] + [
    _case(cp, "bshd", "causal", 4, "fp16", batch=2, seqlen=16384, heads=16, head_dim=128)
    for cp in CP_COMM_TYPES
]


def case_id(case: dict[str, Any]) -> str:
    """Readable pytest id, e.g. ``p2p-bshd-causal-gqa2-fp32``."""
    gqa = case.get("gqa_groups")
    parts = [
        case.get("cp_comm_type", "p2p"),
        case.get("qkv_format", "bshd"),
        case.get("attn_mask", "causal"),
        "mha" if gqa is None else f"gqa{gqa}",
        case.get("dtype", "fp32"),
    ]
    if case.get("seqlen", 64) != 64:
        parts.append(f"s{case['seqlen']}")
    if case.get("broken"):
        parts.append("broken")
    return "-".join(str(p) for p in parts)
