"""Float64 NumPy attention written for these tests, and a random paged batch to feed it.

The oracle implements DESIGN.md §4 directly: s = scale * q.k; soft cap c: s <- c * tanh(s / c);
ALiBi adds -slope * |q_pos - k_pos|; then the mask (causal / sliding window / attention chunk:
keys of the query's chunk only, q_pos // C == k_pos // C); softmax with the
optional sink logit in the denominator only; LSE in natural log; GQA query head h reads KV head
h // (Hq / Hkv).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import pagedattn

# Tolerances of DESIGN.md §5: ||out - ref|| / ||ref|| on random inputs.
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 8e-3}
FP8_TOLERANCE = 6e-2


def rel_err(x, ref) -> float:
    x = f64(x)
    ref = f64(ref)
    assert np.all(np.isfinite(x)), "non-finite values in the result (an element was not written?)"
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def f64(x) -> np.ndarray:
    """Any NumPy array (ml_dtypes included) or CPU/CUDA torch tensor as float64 NumPy."""
    with np.errstate(invalid="ignore"):  # NaN poison
        if hasattr(x, "detach"):
            return x.detach().float().cpu().numpy().astype(np.float64)
    with np.errstate(invalid="ignore"):  # NaN poison in ml_dtypes arrays
        return np.asarray(x).astype(np.float64)


def attend(q, k, v, q_pos, k_pos, scale, *, causal=True, window=None, soft_cap=None,
           alibi=None, sinks=None, two_sided_window=False, chunk=None):
    """One request. q (Tq, Hq, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv), all float64; q_pos (Tq,),
    k_pos (Tk,) absolute positions. Returns out (Tq, Hq, Dv) and lse (Hq, Tq)."""
    tq, hq, _ = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    kx = np.repeat(k, group, axis=1)  # (Tk, Hq, D)
    vx = np.repeat(v, group, axis=1)  # (Tk, Hq, Dv)
    s = scale * np.einsum("qhd,khd->hqk", q, kx)
    if soft_cap is not None:
        s = soft_cap * np.tanh(s / soft_cap)
    dist = q_pos[:, None].astype(np.float64) - k_pos[None, :].astype(np.float64)  # (Tq, Tk)
    if alibi is not None:
        s = s - np.asarray(alibi, dtype=np.float64)[:, None, None] * np.abs(dist)[None]
    visible = np.ones((tq, len(k_pos)), dtype=bool)
    if causal:
        visible &= dist >= 0
    if window is not None:
        visible &= dist <= window - 1
        if two_sided_window:
            visible &= dist >= -(window - 1)
    if chunk is not None:
        visible &= (q_pos[:, None] // chunk) == (k_pos[None, :] // chunk)
    s = np.where(visible[None], s, -np.inf)
    m = s.max(axis=2, initial=-np.inf)  # (Hq, Tq)
    if sinks is not None:
        m = np.maximum(m, np.asarray(sinks, dtype=np.float64)[:, None])
    m_safe = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m_safe[:, :, None])
    denom = p.sum(axis=2)
    if sinks is not None:
        denom = denom + np.exp(np.asarray(sinks, dtype=np.float64)[:, None] - m_safe)
    with np.errstate(divide="ignore", invalid="ignore"):
        w = np.where(denom[:, :, None] > 0, p / denom[:, :, None], 0.0)
        lse = np.where(denom > 0, m_safe + np.log(denom), -np.inf)
    out = np.einsum("hqk,khd->qhd", w, vx)
    return out, lse


@dataclass
class PagedBatch:
    """A random batch: per-request context already in the cache, new tokens to be written."""

    query_lens: list
    context_lens: list
    block_size: int
    num_blocks: int
    block_table: np.ndarray        # (num_reqs, cols) int32
    slot_mapping: np.ndarray       # (num_tokens,) int64
    query_start_loc: np.ndarray    # (num_reqs + 1,) int32
    seq_lens: np.ndarray           # (num_reqs,) int32
    keys: list = field(default_factory=list)    # per request (seq_len, Hkv, D) float32
    values: list = field(default_factory=list)  # per request (seq_len, Hkv, Dv) float32

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    def common(self, **kwargs) -> pagedattn.CommonAttentionMetadata:
        return pagedattn.CommonAttentionMetadata(self.query_start_loc, self.seq_lens,
                                                 self.block_table, self.slot_mapping, **kwargs)

    def slot(self, req: int, pos: int) -> tuple[int, int]:
        return int(self.block_table[req, pos // self.block_size]), pos % self.block_size

    def new_kv(self) -> tuple[np.ndarray, np.ndarray]:
        """key (T, Hkv, D), value (T, Hkv, Dv) float32 of the tokens scheduled this step."""
        ks, vs = [], []
        for r, (ql, cl) in enumerate(zip(self.query_lens, self.context_lens)):
            ks.append(self.keys[r][cl:cl + ql])
            vs.append(self.values[r][cl:cl + ql])
        return np.concatenate(ks), np.concatenate(vs)


def make_batch(rng, query_lens, context_lens, block_size, num_kv_heads, head_size,
               head_size_v=None, spare_blocks=3) -> PagedBatch:
    head_size_v = head_size_v or head_size
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    cols = max(blocks_per_req + [1]) + 1  # one spare column, as a real block table has
    num_blocks = sum(blocks_per_req) + spare_blocks
    ids = rng.permutation(num_blocks).astype(np.int32)
    table = np.zeros((len(seq_lens), cols), dtype=np.int32)
    at = 0
    for r, n in enumerate(blocks_per_req):
        table[r, :n] = ids[at:at + n]
        table[r, n:] = ids[-1]  # unused columns point at a spare block
        at += n
    slots = []
    for r, (ql, cl) in enumerate(zip(query_lens, context_lens)):
        for p in range(cl, cl + ql):
            slots.append(int(table[r, p // block_size]) * block_size + p % block_size)
    qsl = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    batch = PagedBatch(list(query_lens), list(context_lens), block_size, num_blocks, table,
                       np.asarray(slots, dtype=np.int64), qsl, np.asarray(seq_lens, dtype=np.int32))
    for s in seq_lens:
        batch.keys.append(rng.standard_normal((s, num_kv_heads, head_size)).astype(np.float32))
        batch.values.append(rng.standard_normal((s, num_kv_heads, head_size_v)).astype(np.float32))
    return batch


def fill_context(batch: PagedBatch, kv_cache, head_size, head_size_v, k_scale=1.0, v_scale=1.0):
    """Writes each request's context (positions < context_len) into a NumPy cache
    (2, num_blocks, block_size, Hkv, max(D, Dv)) in logical order, quantizing by the scales
    (the cache's dtype conversion rounds)."""
    for r, cl in enumerate(batch.context_lens):
        for p in range(cl):
            b, o = batch.slot(r, p)
            kv_cache[0, b, o, :, :head_size] = batch.keys[r][p] / k_scale
            kv_cache[1, b, o, :, :head_size_v] = batch.values[r][p] / v_scale


def cached_kv(batch: PagedBatch, kv_cache, req: int, head_size, head_size_v, k_scale=1.0,
              v_scale=1.0):
    """The keys (seq_len, Hkv, D) / values (seq_len, Hkv, Dv) of request `req` as the cache holds
    them (float64, dequantized); empty arrays of that shape for a request with seq_len 0."""
    cache = f64(kv_cache)
    hkv = cache.shape[3]
    k, v = [], []
    for p in range(int(batch.seq_lens[req])):
        b, o = batch.slot(req, p)
        k.append(cache[0, b, o, :, :head_size] * k_scale)
        v.append(cache[1, b, o, :, :head_size_v] * v_scale)
    return (np.asarray(k).reshape(-1, hkv, head_size),
            np.asarray(v).reshape(-1, hkv, head_size_v))


def reference_forward(batch: PagedBatch, query, kv_cache, layer_args: dict, head_size,
                      head_size_v=None, k_scale=1.0, v_scale=1.0):
    """Oracle output (T, Hq, Dv) and LSE (Hq, T) of a decoder layer over the cache contents."""
    head_size_v = head_size_v or head_size
    q = f64(query)
    outs, lses = [], []
    for r, (ql, cl) in enumerate(zip(batch.query_lens, batch.context_lens)):
        k, v = cached_kv(batch, kv_cache, r, head_size, head_size_v, k_scale, v_scale)
        start = int(batch.query_start_loc[r])
        q_pos = np.arange(cl, cl + ql)
        k_pos = np.arange(cl + ql)
        o, lse = attend(q[start:start + ql], k, v, q_pos, k_pos, **layer_args)
        outs.append(o)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses, axis=1)


def oracle_args(layer: pagedattn.Attention, window=None, soft_cap=None, alibi=None, sinks=None,
                causal=True, two_sided_window=False, chunk=None) -> dict:
    return dict(scale=float(layer.scale), causal=causal, window=window, soft_cap=soft_cap,
                alibi=alibi, sinks=sinks, two_sided_window=two_sided_window, chunk=chunk)


def random_array(rng, shape, dtype: str, scale: float = 1.0) -> np.ndarray:
    """Random normal values in a NumPy array of framework dtype `dtype` (ml_dtypes for bf16)."""
    from pagedattn._tensors import numpy_dtype

    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(numpy_dtype(dtype))
