"""Tiled attention in NumPy: FlashAttention's forward and paged decode attention, against naive softmax attention.

``python -m runtime.reference.tiled_attention`` checks both on random shapes in fp64 (max |Δ| against the naive
reference), reports the extra memory each needs (tile buffers vs the full score matrix, computed from the
shapes and measured with tracemalloc, which sees NumPy's allocations), and with ``--kernels`` checks the
runtime's paged decode kernels (torch reference, Triton where it runs) against the NumPy paged version.

- ``naive_attention``: softmax(QK^T * scale + mask) V with the whole [Tq, Tk] score matrix materialised.
- ``flash_attention``: FlashAttention's forward (Dao et al. 2022, Algorithm 1 in the FA-2 loop order): for
  each query tile, walk the key tiles keeping a running row max m, a running sum l of exp(s - m) and an
  unnormalised output acc; when a new tile raises the max, l and acc are rescaled by exp(m_old - m_new).
  One division by l at the end. Memory beyond q/k/v/out: one [bq, bk] score tile plus [bq, D] + 2 [bq]
  of state per (batch, head), independent of sequence length.
- ``paged_decode_attention``: one query per sequence over a KV pool [num_blocks, block_size, Hkv, D]
  addressed through a block table; the same online softmax, one block per step, no gather copy.

Shapes: q [B, H, Tq, D], k/v [B, Hkv, Tk, D]; GQA maps query head h to kv head h // (H / Hkv). Causal
masks align the last query with the last key (query i sees keys j <= i + Tk - Tq), as FlashAttention does
for a query chunk appended to a KV cache.
"""

from __future__ import annotations

import argparse
import math
import sys
import tracemalloc
from dataclasses import dataclass

import numpy as np


def _check_shapes(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> tuple[int, int, int, int, int, int]:
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B, H, T, D]; got {q.shape}, {k.shape}, {v.shape}")
    B, H, Tq, D = q.shape
    Bk, Hkv, Tk, Dk = k.shape
    if k.shape != v.shape or Bk != B or Dk != D:
        raise ValueError(f"k {k.shape} and v {v.shape} must be [B={B}, Hkv, Tk, D={D}]")
    if H % Hkv:
        raise ValueError(f"query heads {H} are not a multiple of kv heads {Hkv}")
    if causal and Tq > Tk:
        raise ValueError(f"causal attention needs Tq <= Tk (queries are the last Tq positions), got {Tq} > {Tk}")
    if Tk == 0:
        raise ValueError("attention over zero keys is undefined")
    return B, H, Tq, D, Hkv, Tk


def naive_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool = False, scale: float | None = None):
    """The textbook reference: the full [B, H, Tq, Tk] score matrix, masked, softmaxed, times V."""
    B, H, Tq, D, Hkv, Tk = _check_shapes(q, k, v, causal)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    g = H // Hkv
    qg = q.reshape(B, Hkv, g, Tq, D)
    scores = np.einsum("bkgqd,bksd->bkgqs", qg, k) * scale  # [B, Hkv, g, Tq, Tk]
    if causal:
        allowed = np.arange(Tk)[None, :] <= np.arange(Tq)[:, None] + (Tk - Tq)
        scores[..., ~allowed] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return np.einsum("bkgqs,bksd->bkgqd", scores, v).reshape(B, H, Tq, D)


def flash_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    causal: bool = False,
    block_q: int = 64,
    block_k: int = 64,
    scale: float | None = None,
) -> np.ndarray:
    """FlashAttention forward over [block_q] x [block_k] tiles; every (batch, head) pair at once per tile."""
    B, H, Tq, D, Hkv, Tk = _check_shapes(q, k, v, causal)
    if block_q < 1 or block_k < 1:
        raise ValueError(f"tile sizes must be >= 1, got block_q={block_q}, block_k={block_k}")
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    g = H // Hkv
    qg = q.reshape(B, Hkv, g, Tq, D)
    out = np.empty((B, Hkv, g, Tq, D), dtype=np.result_type(q, k, v))
    offset = Tk - Tq  # causal: query i sits at key position i + offset
    for q0 in range(0, Tq, block_q):
        q1 = min(q0 + block_q, Tq)
        q_tile = qg[:, :, :, q0:q1]  # [B, Hkv, g, bq, D]
        m = np.full(q_tile.shape[:-1], -np.inf)  # running max of each row's scores
        l = np.zeros(q_tile.shape[:-1])  # running sum of exp(score - m)
        acc = np.zeros(q_tile.shape)  # running sum of exp(score - m) * v
        k_end = min(Tk, q1 + offset) if causal else Tk  # key tiles wholly above the diagonal are skipped
        for k0 in range(0, k_end, block_k):
            k1 = min(k0 + block_k, k_end)
            s = np.einsum("bkgqd,bksd->bkgqs", q_tile, k[:, :, k0:k1]) * scale
            if causal and k1 - 1 > q0 + offset:  # the tile crosses the diagonal: mask its upper part
                allowed = np.arange(k0, k1)[None, :] <= np.arange(q0, q1)[:, None] + offset
                s[..., ~allowed] = -np.inf
            m_new = np.maximum(m, s.max(axis=-1))
            # a row with no visible key yet keeps m = -inf; shift it by 0 so exp() gives 0, not nan
            shift = np.where(np.isneginf(m_new), 0.0, m_new)
            alpha = np.exp(m - shift)  # rescales what was summed under the old max
            s -= shift[..., None]
            np.exp(s, out=s)  # s now holds p = exp(s - m_new)
            l = alpha * l + s.sum(axis=-1)
            acc *= alpha[..., None]
            acc += np.einsum("bkgqs,bksd->bkgqd", s, v[:, :, k0:k1])
            m = m_new
        out[:, :, :, q0:q1] = acc / l[..., None]
    return out.reshape(B, H, Tq, D)


def paged_decode_attention(
    q: np.ndarray,
    k_pool: np.ndarray,
    v_pool: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    scale: float | None = None,
) -> np.ndarray:
    """q [B, H, D] over pools [num_blocks, block_size, Hkv, D]: sequence b's token t lives in block
    block_tables[b, t // block_size] at offset t % block_size; only its first context_lens[b] tokens count."""
    B, H, D = q.shape
    N, bs, Hkv, Dk = k_pool.shape
    if v_pool.shape != k_pool.shape or Dk != D or H % Hkv:
        raise ValueError(f"q {q.shape} does not fit pools k {k_pool.shape}, v {v_pool.shape} (H % Hkv == 0)")
    if block_tables.shape[0] != B or context_lens.shape != (B,):
        raise ValueError(f"block_tables {block_tables.shape} / context_lens {context_lens.shape} need B={B} rows")
    if (context_lens < 1).any() or (context_lens > block_tables.shape[1] * bs).any():
        raise ValueError(f"context_lens must be in [1, {block_tables.shape[1] * bs}], got {context_lens.tolist()}")
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    g = H // Hkv
    out = np.empty((B, H, D), dtype=np.result_type(q, k_pool, v_pool))
    for b in range(B):
        qb = q[b].reshape(Hkv, g, D)
        m = np.full((Hkv, g), -np.inf)
        l = np.zeros((Hkv, g))
        acc = np.zeros((Hkv, g, D))
        n = int(context_lens[b])
        for j in range(-(-n // bs)):
            block = int(block_tables[b, j])
            if not 0 <= block < N:
                raise ValueError(f"block table of sequence {b} names block {block}, pool has {N}")
            valid = min(bs, n - j * bs)  # the last block may be partly filled
            kb, vb = k_pool[block, :valid], v_pool[block, :valid]  # [valid, Hkv, D] views, no copy
            s = np.einsum("kgd,tkd->kgt", qb, kb) * scale
            m_new = np.maximum(m, s.max(axis=-1))
            alpha = np.exp(m - m_new)
            p = np.exp(s - m_new[..., None])
            l = alpha * l + p.sum(axis=-1)
            acc = alpha[..., None] * acc + np.einsum("kgt,tkd->kgd", p, vb)
            m = m_new
        out[b] = (acc / l[..., None]).reshape(H, D)
    return out


def gather_paged(pool: np.ndarray, block_tables: np.ndarray, length: int) -> np.ndarray:
    """Contiguous [B, Hkv, length, D] from a pool through block tables (what a gather-then-attend path copies)."""
    B, nb = block_tables.shape
    _, bs, Hkv, D = pool.shape
    return pool[block_tables].reshape(B, nb * bs, Hkv, D)[:, :length].transpose(0, 2, 1, 3)


def naive_paged_attention(q, k_pool, v_pool, block_tables, context_lens, scale: float | None = None) -> np.ndarray:
    """Reference for paged decode: gather each sequence's keys, then naive attention over its own length."""
    out = np.empty(q.shape, dtype=np.result_type(q, k_pool, v_pool))
    for b in range(q.shape[0]):
        n = int(context_lens[b])
        k = gather_paged(k_pool, block_tables[b : b + 1], n)
        v = gather_paged(v_pool, block_tables[b : b + 1], n)
        out[b] = naive_attention(q[b][None, :, None], k, v, scale=scale)[0, :, 0]
    return out


# ---- random cases ------------------------------------------------------------------------------------


@dataclass
class DenseCase:
    B: int
    H: int
    Hkv: int
    Tq: int
    Tk: int
    D: int
    causal: bool
    block_q: int
    block_k: int


def random_dense_case(rng: np.random.Generator) -> DenseCase:
    Hkv = int(rng.integers(1, 4))
    causal = bool(rng.integers(0, 2))
    Tk = int(rng.integers(1, 160))
    Tq = int(rng.integers(1, Tk + 1)) if causal else int(rng.integers(1, 160))
    return DenseCase(
        B=int(rng.integers(1, 4)),
        H=Hkv * int(rng.integers(1, 4)),
        Hkv=Hkv,
        Tq=Tq,
        Tk=Tk,
        D=int(rng.choice([1, 8, 16, 33, 64])),
        causal=causal,
        block_q=int(rng.choice([1, 7, 16, 32, 64])),
        block_k=int(rng.choice([1, 5, 16, 32, 64])),
    )


def dense_inputs(c: DenseCase, rng: np.random.Generator, dtype=np.float64, spread: float = 3.0):
    """Scores spread over several units so the running max really moves between tiles."""
    q = rng.standard_normal((c.B, c.H, c.Tq, c.D)) * spread
    k = rng.standard_normal((c.B, c.Hkv, c.Tk, c.D))
    v = rng.standard_normal((c.B, c.Hkv, c.Tk, c.D))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


@dataclass
class PagedCase:
    B: int
    H: int
    Hkv: int
    D: int
    block_size: int
    num_blocks: int
    max_blocks: int  # block-table width


def random_paged_case(rng: np.random.Generator, block_sizes=(1, 2, 4, 8, 16, 32)) -> PagedCase:
    Hkv = int(rng.integers(1, 4))
    bs = int(rng.choice(block_sizes))
    max_blocks = int(rng.integers(1, max(2, 96 // bs)))
    B = int(rng.integers(1, 5))
    return PagedCase(
        B=B,
        H=Hkv * int(rng.integers(1, 4)),
        Hkv=Hkv,
        D=int(rng.choice([8, 16, 32, 64])),
        block_size=bs,
        num_blocks=B * max_blocks + int(rng.integers(1, 8)),
        max_blocks=max_blocks,
    )


def paged_inputs(c: PagedCase, rng: np.random.Generator, dtype=np.float64, spread: float = 3.0):
    """Pools, block tables drawn without replacement (shuffled: physical order != logical order), lengths
    from 1 to the table's capacity, with row 0 at exactly full blocks."""
    q = (rng.standard_normal((c.B, c.H, c.D)) * spread).astype(dtype)
    k_pool = rng.standard_normal((c.num_blocks, c.block_size, c.Hkv, c.D)).astype(dtype)
    v_pool = rng.standard_normal((c.num_blocks, c.block_size, c.Hkv, c.D)).astype(dtype)
    ids = rng.permutation(c.num_blocks)[: c.B * c.max_blocks]
    tables = ids.reshape(c.B, c.max_blocks).astype(np.int64)
    lens = rng.integers(1, c.max_blocks * c.block_size + 1, size=c.B).astype(np.int64)
    lens[0] = c.max_blocks * c.block_size
    return q, k_pool, v_pool, tables, lens


def check_random_shapes(n: int = 100, seed: int = 0) -> dict:
    """Max |Δ| of flash and paged attention against the naive reference over n random shapes each (fp64)."""
    rng = np.random.default_rng(seed)
    flash_err = paged_err = 0.0
    for _ in range(n):
        c = random_dense_case(rng)
        q, k, v = dense_inputs(c, rng)
        ref = naive_attention(q, k, v, causal=c.causal)
        out = flash_attention(q, k, v, causal=c.causal, block_q=c.block_q, block_k=c.block_k)
        flash_err = max(flash_err, float(np.abs(out - ref).max()))
        pc = random_paged_case(rng)
        args = paged_inputs(pc, rng)
        paged_err = max(paged_err, float(np.abs(paged_decode_attention(*args) - naive_paged_attention(*args)).max()))
    return {"shapes": n, "flash_max_abs_err": flash_err, "paged_max_abs_err": paged_err}


# ---- memory ------------------------------------------------------------------------------------------


def flash_tile_bytes(B: int, H: int, D: int, block_q: int, block_k: int, itemsize: int = 8) -> int:
    """Working state of one query tile for every (batch, head): the score/probability tile [bq, bk] (exp is
    done in place), the accumulator [bq, D], the running max and sum [bq] each. On a GPU each (batch, head,
    query tile) program holds its share of this in SRAM."""
    return B * H * (block_q * block_k + block_q * D + 2 * block_q) * itemsize


def naive_score_bytes(B: int, H: int, Tq: int, Tk: int, itemsize: int = 8) -> int:
    """The full score (then probability) matrix, [B, H, Tq, Tk]."""
    return B * H * Tq * Tk * itemsize


def paged_state_bytes(H: int, D: int, block_size: int, itemsize: int = 8) -> int:
    """Per sequence: one block's scores and probabilities [H, bs] and the state m, l [H], acc [H, D]."""
    return H * (2 * block_size + D + 2) * itemsize


def gathered_kv_bytes(B: int, Hkv: int, S: int, D: int, itemsize: int = 8) -> int:
    """What gather-then-attend copies out of the pool: contiguous K and V [B, Hkv, S, D]."""
    return 2 * B * Hkv * S * D * itemsize


def peak_extra_bytes(fn, *args, **kwargs) -> tuple[int, object]:
    """Peak bytes NumPy allocated during fn beyond its result (tracemalloc traces NumPy's data buffers)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        result = fn(*args, **kwargs)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return peak - base - result.nbytes, result


def memory_table(
    lengths: list[int], B: int = 1, H: int = 8, Hkv: int = 2, D: int = 64, block: int = 64, block_size: int = 16
) -> list[dict]:
    """Extra memory of each attention at each sequence length (Tq = Tk = length, causal; decode over a pool
    of that length): measured with tracemalloc and computed from the shapes."""
    rng = np.random.default_rng(0)
    rows = []
    for n in lengths:
        c = DenseCase(B, H, Hkv, n, n, D, True, block, block)
        q, k, v = dense_inputs(c, rng)
        naive_meas, _ = peak_extra_bytes(naive_attention, q, k, v, causal=True)
        flash_meas, _ = peak_extra_bytes(flash_attention, q, k, v, causal=True, block_q=block, block_k=block)
        nb = -(-n // block_size)
        pc = PagedCase(B, H, Hkv, D, block_size, B * nb + 1, nb)
        pq, kp, vp, tables, _ = paged_inputs(pc, rng)
        lens = np.full(B, n, dtype=np.int64)
        paged_meas, _ = peak_extra_bytes(paged_decode_attention, pq, kp, vp, tables, lens)
        gather_meas, _ = peak_extra_bytes(naive_paged_attention, pq, kp, vp, tables, lens)
        rows.append(
            {
                "length": n,
                "naive_measured": naive_meas,
                "naive_computed": naive_score_bytes(B, H, n, n),
                "flash_measured": flash_meas,
                "flash_computed": flash_tile_bytes(B, H, D, min(block, n), min(block, n)),
                "paged_decode_measured": paged_meas,
                "paged_decode_computed": paged_state_bytes(H, D, block_size),
                "gathered_decode_measured": gather_meas,
                "gathered_decode_computed": gathered_kv_bytes(1, Hkv, n, D) + H * n * 8,
            }
        )
    return rows


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


# ---- the runtime's paged kernels on the same inputs --------------------------------------------------


def check_runtime_paged_kernels(
    n: int = 5, seed: int = 0, dtypes: tuple[str, ...] = ("float32", "float16"), triton: bool = False
) -> list[dict]:
    """The torch reference (and with triton=True the Triton kernel) of runtime/kernels/paged_attention.py
    against the NumPy paged version on the same operands: the torch tensors are rounded to the dtype first
    and the NumPy side computes in fp64 from exactly those values, so the error is the kernel's own. Triton
    needs a GPU or TRITON_INTERPRET=1 set before triton is imported; a power-of-two block size."""
    import torch

    from runtime.kernels.paged_attention import paged_decode_attention as triton_paged
    from runtime.kernels.paged_attention import paged_decode_attention_reference

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        c = random_paged_case(rng, block_sizes=(1, 2, 4, 8, 16))
        c.D = int(rng.choice([8, 16, 32]))  # the interpreter runs every lane in Python: keep it small
        q, k_pool, v_pool, tables, lens = paged_inputs(c, rng)
        for name in dtypes:
            dt = getattr(torch, name)
            tq, tk, tv = (torch.from_numpy(a).to(device, dt) for a in (q, k_pool, v_pool))
            tt, tl = torch.from_numpy(tables).to(device), torch.from_numpy(lens).to(device)
            ref = paged_decode_attention(*(t.double().cpu().numpy() for t in (tq, tk, tv)), tables, lens)
            kernels = {"torch": paged_decode_attention_reference}
            if triton:
                kernels["triton"] = triton_paged
            for kname, fn in kernels.items():
                out = fn(tq, tk, tv, tt, tl).double().cpu().numpy()
                rows.append({"case": i, "dtype": name, "kernel": kname, "max_abs_err": float(np.abs(out - ref).max())})
    return rows


KERNEL_TOLERANCE = {"float32": 1e-5, "float16": 2e-3}  # fp16 output rounding: half an ulp at |x| < 4 is 2e-3


def main(argv: list[str] | None = None) -> None:
    prog = "python -m runtime.reference.tiled_attention"
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", type=int, default=100, help="random shapes per check (default 100)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-6, help="max |Δ| against naive attention in fp64")
    ap.add_argument("--lengths", default="256,512,1024", help="sequence lengths of the memory table")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block", type=int, default=64, help="FlashAttention tile size (queries and keys)")
    ap.add_argument("--block-size", type=int, default=16, help="paged KV block size")
    ap.add_argument("--kernels", action="store_true", help="also check runtime/kernels/paged_attention.py")
    ap.add_argument(
        "--triton", action="store_true", help="with --kernels: the Triton kernel too (GPU or TRITON_INTERPRET=1)"
    )
    ap.add_argument("--kernel-cases", type=int, default=5)
    args = ap.parse_args(argv)
    if args.shapes < 1 or args.block < 1 or args.block_size < 1:
        ap.error("--shapes, --block and --block-size must be >= 1")
    if args.heads % args.kv_heads:
        ap.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    try:
        lengths = [int(x) for x in args.lengths.split(",") if x]
    except ValueError:
        ap.error(f"--lengths: expected comma-separated integers, got {args.lengths!r}")

    res = check_random_shapes(args.shapes, args.seed)
    ok = res["flash_max_abs_err"] <= args.tol and res["paged_max_abs_err"] <= args.tol
    print(
        f"{res['shapes']} random shapes (fp64) vs naive softmax attention: flash max |Δ| "
        f"{res['flash_max_abs_err']:.2e}, paged decode max |Δ| {res['paged_max_abs_err']:.2e} "
        f"(tolerance {args.tol:g}: {'ok' if ok else 'FAILED'})"
    )
    print(
        f"\nextra memory beyond q/k/v/out, fp64, B=1, H={args.heads}, Hkv={args.kv_heads}, D={args.head_dim}, "
        f"tiles {args.block}x{args.block}, KV blocks of {args.block_size} (measured with tracemalloc / computed)"
    )
    print(f"{'length':>7} {'naive scores':>24} {'flash tiles':>24} {'gather+decode':>24} {'paged decode':>24}")
    for r in memory_table(lengths, 1, args.heads, args.kv_heads, args.head_dim, args.block, args.block_size):
        cells = [
            f"{fmt_bytes(r[m + '_measured'])} / {fmt_bytes(r[m + '_computed'])}"
            for m in ("naive", "flash", "gathered_decode", "paged_decode")
        ]
        print(f"{r['length']:>7} " + " ".join(f"{c:>24}" for c in cells))
    if args.kernels:
        rows = check_runtime_paged_kernels(args.kernel_cases, args.seed, triton=args.triton)
        print("\nruntime paged kernels vs NumPy paged attention (same rounded operands):")
        for (kname, dt), errs in _group(rows).items():
            good = max(errs) <= KERNEL_TOLERANCE[dt]
            ok &= good
            print(f"  {kname:<7}{dt:<9} max |Δ| {max(errs):.2e} over {len(errs)} cases ({'ok' if good else 'FAILED'})")
    if not ok:
        sys.exit("tiled attention check failed")


def _group(rows: list[dict]) -> dict[tuple[str, str], list[float]]:
    out: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        out.setdefault((r["kernel"], r["dtype"]), []).append(r["max_abs_err"])
    return out


if __name__ == "__main__":
    main()
