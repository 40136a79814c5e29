"""pagedattn.MLAAttention and the MLA ops against a float64 NumPy oracle written here: the
UN-absorbed MLA formula (per head k = [kv_c . W_UK[h]^T, k_pe], v = kv_c . W_UV[h]^T, causal
with context), independent of the library's absorbed decode and chunked prefill. Decode,
prefill with context in several chunks, mixed batches, fp8 caches, the selector queries and bad
arguments; NumPy, PyTorch CPU and (on a GPU machine) PyTorch CUDA tensors."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import pagedattn
from pagedattn._tensors import numpy_dtype
from attention_oracle import FP8_TOLERANCE, TOLERANCE, attend, f64, make_batch, rel_err

# Small dimensions the CPU backends run (multiples of 16), V != P on purpose; DeepSeek's on CUDA
# (CUDA_MLA needs kv_lora_rank 512 / rope 64; its prefill q/k 192, v 128) with few heads.
CPU_DIMS = dict(num_heads=4, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
                v_head_dim=48)
CUDA_DIMS = dict(num_heads=4, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                 v_head_dim=128)

CASES = {
    "decode": dict(query_lens=[1, 1, 1], context_lens=[17, 40, 5]),
    "prefill_no_context": dict(query_lens=[9, 3], context_lens=[0, 0]),
    "mixed": dict(query_lens=[1, 1, 7, 12], context_lens=[30, 3, 20, 0]),
}


def dims_of(fw) -> dict:
    return CUDA_DIMS if fw.device == "cuda" else CPU_DIMS


def exact_dtype(fw) -> str:
    """float32 where a backend runs it (CPU); CUDA_MLA takes 16-bit activations only."""
    return "bfloat16" if fw.device == "cuda" else "float32"


def mla_dimensions(d: dict) -> pagedattn.MLADimensions:
    return pagedattn.MLADimensions(d["kv_lora_rank"], d["qk_nope_head_dim"],
                                   d["qk_rope_head_dim"], d["v_head_dim"])


def kv_b_proj_weight(rng, d: dict) -> np.ndarray:
    """(H * (P + V), L) float32 with entries ~ N(0, 1/L): up-projected k_nope / v are ~ N(0, 1)."""
    rows = d["num_heads"] * (d["qk_nope_head_dim"] + d["v_head_dim"])
    return (rng.standard_normal((rows, d["kv_lora_rank"])) / np.sqrt(d["kv_lora_rank"])).astype(np.float32)


def make_mla_layer(fw, dtype, d, weight=None, backend=None, kv_cache_dtype="auto", block_size=16,
                   **kwargs):
    """An MLAAttention layer, or a skip (with the reasons) when the requested backend, or on
    CUDA any backend, cannot run this configuration."""
    if backend is not None:
        reasons = pagedattn.find_backend(backend).validate_configuration(
            d["kv_lora_rank"] + d["qk_rope_head_dim"], dtype, kv_cache_dtype, block_size,
            use_mla=True, device=fw.device, mla_dimensions=mla_dimensions(d),
            num_heads=d["num_heads"])
        if reasons:
            pytest.skip(f"{backend}: " + " ".join(reasons))
    try:
        return pagedattn.MLAAttention(
            d["num_heads"], None, d["qk_nope_head_dim"], d["qk_rope_head_dim"], d["v_head_dim"],
            None, d["kv_lora_rank"], None if weight is None else fw.array(weight, dtype),
            kv_cache_dtype=kv_cache_dtype, block_size=block_size, dtype=dtype, device=fw.device,
            backend=backend, **kwargs)
    except pagedattn.Error as exc:
        if fw.device == "cuda":
            pytest.skip(f"no MLA backend runs this configuration on CUDA: {exc}")
        raise


class MLAStep:
    """One random step: latent rows of every position (context in the cache, new tokens given
    to forward), queries, the batch's paged metadata. Inputs are rounded to the activation dtype
    before the oracle sees them, so only the library's arithmetic is measured."""

    def __init__(self, fw, rng, layer, query_lens, context_lens, k_scale=1.0):
        d = dict(num_heads=layer.num_heads, kv_lora_rank=layer.kv_lora_rank,
                 qk_rope_head_dim=layer.qk_rope_head_dim)
        self.fw, self.layer, self.k_scale = fw, layer, k_scale
        L, R = layer.kv_lora_rank, layer.qk_rope_head_dim
        self.batch = make_batch(rng, query_lens, context_lens, layer.block_size, 1, L + R,
                                head_size_v=1)
        dtype = numpy_dtype(layer.dtype)
        # Latent rows per request (seq_len, L + R), in the activation dtype's values.
        self.latents = [k[:, 0, :].astype(dtype).astype(np.float64) for k in self.batch.keys]
        t = self.batch.num_tokens
        new = np.concatenate([lat[c:c + q] for lat, q, c in
                              zip(self.latents, query_lens, context_lens)]) if t else \
            np.zeros((0, L + R))
        self.kv_c = fw.array(new[:, :L], layer.dtype)
        self.k_pe = fw.array(new[:, L:], layer.dtype)
        self.q = fw.array(rng.standard_normal((t, d["num_heads"], layer.qk_head_dim)), layer.dtype)

    def cache(self):
        """The layer's cache, NaN everywhere but the context rows (stored as x / k_scale)."""
        cache = self.layer.allocate_kv_cache(self.batch.num_blocks,
                                             framework=self.fw.cache_framework())
        self.fw.fill(cache, float("nan"))
        host = self.fw.host(cache)
        for r, cl in enumerate(self.batch.context_lens):
            for p in range(cl):
                b, o = self.batch.slot(r, p)
                host[b, o] = self.latents[r][p] / self.k_scale
        self.fw.assign(cache, host)
        return cache

    def common(self):
        return self.batch.common()


def mla_oracle(step: MLAStep, weight, cache_after, num_decodes: int):
    """float64 out (T, H, V) and lse (H, T) of the un-absorbed formula. Keys/values of a
    position come from the cache (dequantized) for the context and for decode tokens, and from
    kv_c_normed / k_pe as given for prefill tokens (vLLM's fp8 semantics; the same values for
    an "auto" cache)."""
    layer, batch = step.layer, step.batch
    H, L, P, V = layer.num_heads, layer.kv_lora_rank, layer.qk_nope_head_dim, layer.v_head_dim
    w = f64(weight).reshape(H, P + V, L)
    w_uk, w_uv = w[:, :P], w[:, P:]                   # (H, P, L), (H, V, L)
    cache = f64(cache_after) * step.k_scale
    q = f64(step.q)
    outs, lses = [], []
    for r, (ql, cl) in enumerate(zip(batch.query_lens, batch.context_lens)):
        rows = []
        for p in range(cl + ql):
            if p < cl or r < num_decodes:
                b, o = batch.slot(r, p)
                rows.append(cache[b, o])
            else:
                rows.append(step.latents[r][p])
        lat = np.asarray(rows).reshape(cl + ql, L + layer.qk_rope_head_dim)
        kv_c, k_pe = lat[:, :L], lat[:, L:]
        k_nope = np.einsum("sl,hpl->shp", kv_c, w_uk)
        k = np.concatenate([k_nope, np.broadcast_to(k_pe[:, None], (len(lat), H, k_pe.shape[1]))], -1)
        v = np.einsum("sl,hvl->shv", kv_c, w_uv)
        start = int(batch.query_start_loc[r])
        o, lse = attend(q[start:start + ql], k, v, np.arange(cl, cl + ql), np.arange(cl + ql),
                        float(layer.scale))
        outs.append(o)
        lses.append(lse)
    return np.concatenate(outs), np.concatenate(lses, axis=1)


def run_and_check(fw, step, weight, tolerance, builder=None, check_writes=True):
    layer = step.layer
    t = step.batch.num_tokens
    cache = step.cache()
    builder = builder or layer.metadata_builder(max_num_seqs=8, max_num_batched_tokens=256,
                                                max_model_len=512)
    md = builder.build(step.common())
    assert isinstance(md, pagedattn.MLAAttentionMetadata)
    output = fw.empty((t, layer.num_heads, layer.v_head_dim), layer.dtype)
    lse = fw.empty((layer.num_heads, t), "float32")
    fw.fill(output, float("nan"))
    fw.fill(lse, float("nan"))
    result = layer.forward(step.q, step.kv_c, step.k_pe, cache, md, output=output, output_lse=lse)
    assert result[0] is output and result[1] is lse
    host_cache = fw.host(cache)
    if check_writes:  # the new rows went where slot_mapping says, [kv_c, k_pe] / k_scale
        new = np.concatenate([f64(step.kv_c), f64(step.k_pe)], axis=1)
        want = (new / step.k_scale).astype(np.float32).astype(numpy_dtype(layer.kv_cache_storage_dtype))
        for i, slot in enumerate(step.batch.slot_mapping):
            b, o = divmod(int(slot), layer.block_size)
            np.testing.assert_array_equal(host_cache[b, o], want[i].astype(np.float64))
    ref_out, ref_lse = mla_oracle(step, weight_as_activation(weight, layer.dtype), host_cache,
                                  md.num_decodes)
    assert rel_err(fw.host(output), ref_out) <= tolerance, layer.backend.name
    assert rel_err(fw.host(lse), ref_lse) <= max(tolerance, 1e-5), layer.backend.name
    return md


def weight_as_activation(weight, dtype):
    return weight.astype(numpy_dtype(dtype)).astype(np.float64)


def mla_backend_params():
    """None (the selector's choice) and every registered MLA backend (feature "mla")."""
    return [None] + [b.name for b in pagedattn.list_backends() if "mla" in b.capabilities()["features"]]


@pytest.mark.parametrize("backend", mla_backend_params(), ids=lambda b: b or "selected")
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_forward_matches_float64_oracle(fw, rng, dtype, case, backend):
    d = dims_of(fw)
    weight = kv_b_proj_weight(rng, d)
    layer = make_mla_layer(fw, dtype, d, weight, backend=backend)
    step = MLAStep(fw, rng, layer, **CASES[case])
    md = run_and_check(fw, step, weight, TOLERANCE[dtype])
    q = CASES[case]["query_lens"]
    assert md.num_decodes == sum(1 for x in q if x == 1)
    assert md.num_prefills == len(q) - md.num_decodes
    assert md.num_decode_tokens + md.num_prefill_tokens == sum(q) == md.num_actual_tokens


@pytest.mark.parametrize("backend", mla_backend_params(), ids=lambda b: b or "selected")
def test_prefill_context_in_several_chunks(fw, rng, backend):
    """A small chunked-prefill workspace (64 tokens, 2 prefills with context: 32 context tokens
    per prefill per chunk) splits 100 tokens of context into 4 chunks merged by LSE."""
    d = dims_of(fw)
    weight = kv_b_proj_weight(rng, d)
    layer = make_mla_layer(fw, "bfloat16", d, weight, backend=backend)
    builder = layer.metadata_builder(max_num_seqs=4, max_num_batched_tokens=128,
                                     max_model_len=256, chunked_prefill_workspace_tokens=64)
    step = MLAStep(fw, rng, layer, query_lens=[1, 6, 11, 4], context_lens=[50, 100, 37, 0])
    md = run_and_check(fw, step, weight, TOLERANCE["bfloat16"], builder=builder)
    assert (md.num_decodes, md.num_prefills) == (1, 3)
    assert md.max_context_chunk == 32 and md.num_context_chunks == 4


@pytest.mark.parametrize("backend", mla_backend_params(), ids=lambda b: b or "selected")
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_cache(fw, rng, kv_cache_dtype, backend):
    d = dims_of(fw)
    weight = kv_b_proj_weight(rng, d)
    layer = make_mla_layer(fw, "bfloat16", d, weight, backend=backend,
                           kv_cache_dtype=kv_cache_dtype)
    layer.k_scale = 0.5  # a power of two: x / scale is exact before rounding to fp8
    name = "float8_e4m3fn" if kv_cache_dtype == "fp8" else "float8_e5m2"
    assert layer.kv_cache_storage_dtype == name and layer.kv_cache_spec.dtype == name
    builder = layer.metadata_builder(max_num_seqs=4, max_num_batched_tokens=128,
                                     max_model_len=256, chunked_prefill_workspace_tokens=64)
    step = MLAStep(fw, rng, layer, query_lens=[1, 1, 9, 5], context_lens=[23, 60, 70, 0],
                   k_scale=0.5)
    md = run_and_check(fw, step, weight, FP8_TOLERANCE, builder=builder)
    assert md.num_context_chunks >= 2


def test_fused_fp8_output(fw, rng):
    """fp8_output=True: the selector takes an MLA backend with fused fp8 output (REFERENCE_MLA
    on the CPU, CUDA_MLA on a GPU); forward(output_scale=) writes e4m3 = saturate(o / scale) on
    decodes, a prefill without context and prefills whose context takes several chunks."""
    d = dims_of(fw)
    weight = kv_b_proj_weight(rng, d)
    layer = make_mla_layer(fw, "bfloat16", d, weight, fp8_output=True)
    assert layer.backend.name in ("REFERENCE_MLA", "CUDA_MLA")
    assert "fp8_output" in layer.backend.capabilities()["features"]
    builder = layer.metadata_builder(max_num_seqs=4, max_num_batched_tokens=128,
                                     max_model_len=256, chunked_prefill_workspace_tokens=64)
    step = MLAStep(fw, rng, layer, query_lens=[1, 1, 9, 5], context_lens=[23, 60, 70, 0])
    cache = step.cache()
    md = builder.build(step.common())
    assert md.num_context_chunks >= 2
    scale = 1.0 / 16
    out, lse = layer.forward(step.q, step.kv_c, step.k_pe, cache, md, return_lse=True,
                             output_scale=fw.array([scale], "float32"))
    assert "float8_e4m3" in str(out.dtype)
    host = fw.host(out)
    assert np.isfinite(host).all()  # every element written
    ref, ref_lse = mla_oracle(step, weight_as_activation(weight, "bfloat16"), fw.host(cache),
                              md.num_decodes)
    assert rel_err(host * scale, ref) <= FP8_TOLERANCE
    assert rel_err(fw.host(lse), ref_lse) <= TOLERANCE["bfloat16"]
    if fw.device == "cpu":  # a host scale is checked: not positive and finite raises
        before = fw.host(cache).copy()
        with raises_naming("output_scale"):
            layer.forward(step.q, step.kv_c, step.k_pe, cache, md,
                          output_scale=fw.array([0.0], "float32"))
        np.testing.assert_array_equal(np.isnan(fw.host(cache)), np.isnan(before))
        np.testing.assert_array_equal(np.nan_to_num(fw.host(cache)), np.nan_to_num(before))


def test_two_dimensional_output_and_return_lse(fw, rng):
    d = dims_of(fw)
    dtype = exact_dtype(fw)
    weight = kv_b_proj_weight(rng, d)
    layer = make_mla_layer(fw, dtype, d, weight)
    step = MLAStep(fw, rng, layer, query_lens=[1, 5], context_lens=[12, 4])
    cache = step.cache()
    md = layer.metadata_builder().build(step.common())
    h, v, t = layer.num_heads, layer.v_head_dim, step.batch.num_tokens
    out2d = fw.empty((t, h * v), dtype)
    fw.fill(out2d, float("nan"))
    assert layer.forward(step.q, step.kv_c, step.k_pe, cache, md, output=out2d) is out2d
    ref, ref_lse = mla_oracle(step, weight_as_activation(weight, dtype), fw.host(cache), md.num_decodes)
    assert rel_err(fw.host(out2d).reshape(t, h, v), ref) <= TOLERANCE[dtype]
    # Allocated beside q: (T, H, V) and, with return_lse, lse (H, T) float32.
    out, lse = layer.forward(step.q, step.kv_c, step.k_pe, cache, md, return_lse=True)
    assert fw.is_tensor(out) and tuple(out.shape) == (t, h, v)
    assert fw.is_tensor(lse) and tuple(lse.shape) == (h, t)
    assert rel_err(fw.host(out), ref) <= TOLERANCE[dtype]
    assert rel_err(fw.host(lse), ref_lse) <= max(TOLERANCE[dtype], 1e-5)
    # k_pe as (T, 1, R), as vLLM passes it.
    k_pe3 = step.k_pe.reshape(t, 1, layer.qk_rope_head_dim)
    out = layer.forward(step.q, step.kv_c, k_pe3, cache, md)
    assert rel_err(fw.host(out), ref) <= TOLERANCE[dtype]


def test_weights_given_later_and_reprocessed(fw, rng):
    """kv_b_proj=None: forward refuses until process_weights_after_loading(weight); a weight
    updated in place is re-read by process_weights_after_loading() (vLLM's loading order)."""
    d = dims_of(fw)
    dtype = exact_dtype(fw)
    layer = make_mla_layer(fw, dtype, d, None)
    step = MLAStep(fw, rng, layer, query_lens=[1, 3], context_lens=[9, 2])
    cache = step.cache()
    md = layer.metadata_builder().build(step.common())
    with raises_naming("kv_b_proj"):
        layer.forward(step.q, step.kv_c, step.k_pe, cache, md)
    with raises_naming("kv_b_proj"):
        layer.process_weights_after_loading()
    w_dev = fw.array(np.zeros((d["num_heads"] * (d["qk_nope_head_dim"] + d["v_head_dim"]),
                               d["kv_lora_rank"])), dtype)
    layer.process_weights_after_loading(w_dev)
    weight = kv_b_proj_weight(rng, d)
    fw.assign(w_dev, weight)  # "loaded" in place after the first processing
    layer.process_weights_after_loading()
    out = layer.forward(step.q, step.kv_c, step.k_pe, cache, md)
    ref, _ = mla_oracle(step, weight_as_activation(weight, dtype), fw.host(cache), md.num_decodes)
    assert rel_err(fw.host(out), ref) <= TOLERANCE[dtype]


def test_kv_sharing_layer_reads_the_target_cache(fw, rng):
    d = dims_of(fw)
    dtype = exact_dtype(fw)
    weight = kv_b_proj_weight(rng, d)
    model = pagedattn.StaticForwardContext()
    first = make_mla_layer(fw, dtype, d, weight, prefix="layers.0.attn",
                           static_forward_context=model)
    second = make_mla_layer(fw, dtype, d, weight, prefix="layers.1.attn",
                            kv_sharing_target_layer_name="layers.0.attn",
                            static_forward_context=model)
    assert model["layers.1.attn"].use_mla
    step = MLAStep(fw, rng, first, query_lens=[1, 4], context_lens=[20, 0])
    cache = step.cache()
    md = first.metadata_builder().build(step.common())
    first.forward(step.q, step.kv_c, step.k_pe, cache, md)
    before = fw.host(cache).copy()
    out = second.forward(step.q, step.kv_c, step.k_pe, cache, md)
    np.testing.assert_array_equal(fw.host(cache), before)
    ref, _ = mla_oracle(step, weight_as_activation(weight, dtype), before, md.num_decodes)
    assert rel_err(fw.host(out), ref) <= TOLERANCE[dtype]


# ---- ops ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_cache_dtype, storage", [
    ("auto", "bfloat16"), ("fp8", "float8_e4m3fn"), ("fp8_e5m2", "float8_e5m2")])
def test_concat_and_cache_mla_and_gather(fw, rng, kv_cache_dtype, storage):
    L, R, bs, num_blocks = 64, 16, 16, 6
    scale = 2.0 if kv_cache_dtype != "auto" else 1.0
    n = 9
    kv_c = fw.array(rng.standard_normal((n, L)), "bfloat16")
    k_pe = fw.array(rng.standard_normal((n, 1, R)), "bfloat16")
    cache = fw.empty((num_blocks, bs, L + R), storage)
    fw.fill(cache, float("nan"))
    slots = rng.permutation(num_blocks * bs)[:n].astype(np.int64)
    slots[3] = -1
    pagedattn.concat_and_cache_mla(kv_c, k_pe, cache, fw.ints(slots), kv_cache_dtype,
                                   fw.array([scale], "float32"))
    host = fw.host(cache)
    rows = np.concatenate([f64(kv_c), f64(k_pe)[:, 0]], axis=1)
    want = (rows / scale).astype(np.float32).astype(numpy_dtype(storage)).astype(np.float64)
    written = np.zeros((num_blocks, bs), dtype=bool)
    for i, s in enumerate(slots):
        if s >= 0:
            np.testing.assert_array_equal(host[s // bs, s % bs], want[i])
            written[s // bs, s % bs] = True
    assert np.isnan(host[~written]).all()  # nothing else was touched

    # gather_and_maybe_dequant_cache: two requests reading rows through a block table.
    host_fill = np.where(np.isnan(host), 0.0, host)  # a fully defined cache to gather from
    fw.assign(cache, host_fill)
    table = np.array([[4, 1, 0], [2, 5, 3]], dtype=np.int32)
    cu = np.array([0, 20, 27], dtype=np.int32)
    starts = np.array([3, 17], dtype=np.int32)
    dst = fw.empty((30, L + R), "bfloat16")  # fp8 * 2 and bf16 values are exact in bf16
    fw.fill(dst, float("nan"))
    pagedattn.gather_and_maybe_dequant_cache(cache, dst, fw.ints(table, np.int32),
                                             fw.ints(cu, np.int32), 2, kv_cache_dtype, scale,
                                             seq_starts=fw.ints(starts, np.int32))
    got = fw.host(dst)
    for r in range(2):
        for j in range(cu[r + 1] - cu[r]):
            pos = starts[r] + j
            np.testing.assert_array_equal(got[cu[r] + j],
                                          host_fill[table[r, pos // bs], pos % bs] * scale)
    assert np.isnan(got[27:]).all()


# ---- spec, selector queries -----------------------------------------------------------------

def test_mla_spec_and_layer_properties():
    dims = pagedattn.MLADimensions(512, 128, 64, 128)
    assert (dims.latent_head_size, dims.qk_head_dim) == (576, 192)
    assert dims == pagedattn.MLADimensions(kv_lora_rank=512, qk_nope_head_dim=128,
                                           qk_rope_head_dim=64, v_head_dim=128)
    assert "kv_lora_rank=512" in repr(dims)
    spec = pagedattn.mla_attention_spec(64, dims, "bfloat16")
    assert (spec.kind, spec.num_kv_heads, spec.head_size, spec.dtype) == ("mla", 1, 576, "bfloat16")
    assert spec.page_size_bytes == 64 * 576 * 2
    assert pagedattn.mla_attention_spec(64, dims, "bfloat16", "fp8").page_size_bytes == 64 * 576
    assert pagedattn.mla_chunked_prefill_workspace_tokens(8192, 256, 64) == 64 * 1024
    assert pagedattn.mla_chunked_prefill_workspace_tokens(1024, 4, 16) == 8192

    layer = pagedattn.MLAAttention(4, 0.125, 32, 16, 48, 96, 64, prefix="l0", dtype="float32",
                                   block_size=16)
    assert layer.backend.name in ("CPU_MLA", "REFERENCE_MLA")
    assert layer.kv_cache_spec == pagedattn.mla_attention_spec(16, layer.mla_dimensions, "float32")
    assert (layer.num_heads, layer.scale, layer.q_lora_rank, layer.head_size) == (4, 0.125, 96, 80)
    assert (layer.qk_head_dim, layer.num_kv_heads, layer.layer_name) == (48, 1, "l0")
    assert layer.prefill_backend in [b.name for b in pagedattn.list_mla_prefill_backends()]
    assert pagedattn.MLAAttention(4, None, 32, 16, 48, None, 64).scale == pytest.approx(48 ** -0.5)
    cache = layer.allocate_kv_cache(3)
    assert cache.shape == (3, 16, 80) and str(cache.dtype) == "float32" and not cache.any()
    forced = pagedattn.MLAAttention(4, None, 32, 16, 48, None, 64, dtype="float32",
                                    block_size=16, backend="CPU_MLA", prefill_backend="reference")
    assert forced.backend.name == "CPU_MLA" and forced.prefill_backend == "REFERENCE"
    oracle = pagedattn.MLAAttention(4, None, 32, 16, 48, None, 64, dtype="float32",
                                    block_size=16, backend="REFERENCE_MLA")
    assert oracle.backend.name == "REFERENCE_MLA"  # the oracle runs its fp64 prefill itself
    assert oracle.prefill_backend == "REFERENCE"
    with pytest.raises(ValueError, match="prefill_backend"):
        pagedattn.MLAAttention(4, None, 32, 16, 48, None, 64, dtype="float32", block_size=16,
                               backend="REFERENCE_MLA", prefill_backend="CPU")
    builder = forced.metadata_builder()
    assert builder.reorder_batch_threshold == 1
    # Speculative requests (up to 1 + k tokens) are absorbed decodes for MLA too.
    spec = forced.metadata_builder(num_speculative_tokens=3)
    assert spec.reorder_batch_threshold == 4
    assert spec.reorder_batch([5, 3, 1]) == ([2, 1, 0], True)
    assert builder.reorder_batch([5, 1, 1]) == ([2, 1, 0], True)
    assert builder.kv_cache_spec.kind == "mla"


def test_mla_prefill_selector_queries():
    backends = pagedattn.list_mla_prefill_backends()
    names = [b.name for b in backends]
    assert names[-1] == "REFERENCE" and len(set(names)) == len(names)
    dims = pagedattn.MLADimensions(64, 32, 16, 48)
    assert pagedattn.device_capability("cpu") == (0, 0)
    for b in backends:
        assert pagedattn.find_mla_prefill_backend(b.name.lower()) == b
        assert b.get_name() == b.name and b.name in repr(b)
        assert b.device in ("cpu", "cuda") and b.supported_dtypes
        assert b.supports_dtype(b.supported_dtypes[0]) and b.is_available() in (True, False)
    assert pagedattn.find_mla_prefill_backend("no-such") is None
    report = pagedattn.explain_mla_prefill_backends("bfloat16", dims, "cpu")
    assert [b.name for b, _ in report] == names
    chosen = pagedattn.get_mla_prefill_backend("bfloat16", dims, "cpu")
    assert chosen == next(b for b, reasons in report if not reasons) and chosen.device == "cpu"
    ref = pagedattn.find_mla_prefill_backend("REFERENCE")
    assert ref.validate_configuration("float32", dims, "cpu") == []
    reasons = ref.validate_configuration("bfloat16", dims, "cuda", device_capability=(9, 0))
    assert reasons and any("device cuda" in r for r in reasons)
    assert pagedattn.get_mla_prefill_backend("float32", dims, backend="reference") == ref
    # A CUDA prefill backend (when compiled in) names cpu as its reason here.
    for b, reasons in report:
        if b.device == "cuda":
            assert any("device cpu" in r for r in reasons)


# ---- bad arguments --------------------------------------------------------------------------

@contextlib.contextmanager
def raises_naming(argument: str):
    """Expects a pagedattn.Error (a ValueError) whose message and .argument name `argument`."""
    with pytest.raises(ValueError) as info:
        yield info
    err = info.value
    assert isinstance(err, pagedattn.Error), type(err)
    assert argument in str(err), str(err)
    assert err.argument == argument, (err.argument, str(err))


@pytest.fixture
def setup(rng):
    d = CPU_DIMS
    weight = kv_b_proj_weight(rng, d)
    layer = pagedattn.MLAAttention(d["num_heads"], None, d["qk_nope_head_dim"],
                                   d["qk_rope_head_dim"], d["v_head_dim"], None,
                                   d["kv_lora_rank"], weight, block_size=16, dtype="float32",
                                   prefix="l0")
    step = MLAStep(make_numpy(), rng, layer, query_lens=[1, 5], context_lens=[7, 0])
    cache = step.cache()
    md = layer.metadata_builder().build(step.common())
    return layer, step, cache, md


def make_numpy():
    from frameworks import NumpyFramework

    return NumpyFramework()


@pytest.mark.parametrize("bad, argument", [
    ("q_shape", "q"), ("q_dtype", "q"), ("q_list", "q"), ("kv_c_shape", "kv_c_normed"),
    ("kv_c_dtype", "kv_c_normed"), ("k_pe_shape", "k_pe"), ("cache_dtype", "kv_cache"),
    ("cache_shape", "kv_cache"), ("cache_readonly", "kv_cache"), ("output_shape", "output"),
    ("output_dtype", "output"), ("lse_dtype", "output_lse"), ("lse_shape", "output_lse"),
    ("metadata_none", "attn_metadata"), ("metadata_standard", "attn_metadata"),
])
def test_forward_rejects_bad_arguments_and_leaves_the_cache_untouched(setup, bad, argument):
    layer, step, cache, md = setup
    t, h, v = step.batch.num_tokens, layer.num_heads, layer.v_head_dim
    args = dict(q=step.q, kv_c_normed=step.kv_c, k_pe=step.k_pe, kv_cache=cache,
                attn_metadata=md, output=None, output_lse=None)
    if bad == "q_shape":
        args["q"] = step.q[:, :, :-1]
    elif bad == "q_dtype":
        args["q"] = step.q.astype(np.float16)
    elif bad == "q_list":
        args["q"] = step.q.tolist()
    elif bad == "kv_c_shape":
        args["kv_c_normed"] = step.kv_c[:, :-16]
    elif bad == "kv_c_dtype":
        args["kv_c_normed"] = step.kv_c.astype(np.float16)
    elif bad == "k_pe_shape":
        args["k_pe"] = np.ascontiguousarray(step.k_pe[:-1])
    elif bad == "cache_dtype":
        args["kv_cache"] = cache.astype(np.float16)
    elif bad == "cache_shape":
        args["kv_cache"] = cache[:, :, :-1]
    elif bad == "cache_readonly":
        ro = cache.copy()
        ro.flags.writeable = False
        args["kv_cache"] = ro
    elif bad == "output_shape":
        args["output"] = np.zeros((t, h, v + 1), np.float32)
    elif bad == "output_dtype":
        args["output"] = np.zeros((t, h, v), np.float16)
    elif bad == "lse_dtype":
        args["output_lse"] = np.zeros((h, t), np.float16)
    elif bad == "lse_shape":
        args["output_lse"] = np.zeros((t, h), np.float32)
    elif bad == "metadata_none":
        args["attn_metadata"] = None
    elif bad == "metadata_standard":
        std = pagedattn.Attention(4, 32, None, num_kv_heads=1, dtype="float32")
        args["attn_metadata"] = std.metadata_builder().build(step.common())
    before = cache.copy()
    with raises_naming(argument):
        layer.forward(**args)
    np.testing.assert_array_equal(np.isnan(cache), np.isnan(before))
    np.testing.assert_array_equal(np.nan_to_num(cache), np.nan_to_num(before))


def test_fp8_output_on_a_backend_without_it_is_an_error(setup):
    layer, step, cache, md = setup
    assert layer.backend.name == "CPU_MLA"
    assert "fp8_output" not in layer.backend.capabilities()["features"]
    before = cache.copy()
    with raises_naming("output_scale"):
        layer.forward(step.q, step.kv_c, step.k_pe, cache, md,
                      output_scale=np.array([0.5], np.float32))
    np.testing.assert_array_equal(np.isnan(cache), np.isnan(before))
    np.testing.assert_array_equal(np.nan_to_num(cache), np.nan_to_num(before))
    with raises_naming("backend") as info:
        pagedattn.MLAAttention(4, None, 32, 16, 48, None, 64, block_size=16, dtype="float32",
                               backend="CPU_MLA", fp8_output=True)
    assert "CPU_MLA writes its output in the activation dtype" in str(info.value)


@pytest.mark.parametrize("kwargs, argument", [
    (dict(kv_lora_rank=0), "kv_lora_rank"), (dict(num_heads=-1), "num_heads"),
    (dict(v_head_dim=0), "v_head_dim"), (dict(scale=0.0), "scale"),
    (dict(scale=float("nan")), "scale"), (dict(kv_cache_dtype="int8"), "kv_cache_dtype"),
    (dict(dtype="float64"), "dtype"), (dict(device="tpu"), "device"),
    (dict(backend="FLASH_NOPE"), "backend"), (dict(prefill_backend="no-such"), "prefill_backend"),
    (dict(backend="REFERENCE"), "backend"), (dict(q_lora_rank=0), "q_lora_rank"),
    (dict(kv_sharing_target_layer_name="l0"), "kv_sharing_target_layer_name"),
])
def test_constructor_rejects_bad_arguments(kwargs, argument):
    args = dict(num_heads=4, scale=None, qk_nope_head_dim=32, qk_rope_head_dim=16,
                v_head_dim=48, q_lora_rank=None, kv_lora_rank=64, block_size=16,
                dtype="float32", prefix="l0")
    args.update(kwargs)
    with raises_naming(argument):
        pagedattn.MLAAttention(**args)


def test_forced_prefill_backend_that_does_not_fit_says_why():
    cuda_only = [b for b in pagedattn.list_mla_prefill_backends() if b.device == "cuda"]
    if not cuda_only:
        pytest.skip("no CUDA MLA prefill backend compiled in")
    with pytest.raises(pagedattn.Error) as info:
        pagedattn.MLAAttention(4, None, 32, 16, 48, None, 64, block_size=16, dtype="float32",
                               prefill_backend=cuda_only[0].name)
    assert "device cpu" in str(info.value)


@pytest.mark.parametrize("bad", ["shape", "dtype", "strided", "none"])
def test_process_weights_rejects_bad_weights(rng, bad):
    d = CPU_DIMS
    layer = pagedattn.MLAAttention(4, None, 32, 16, 48, None, 64, block_size=16, dtype="float32")
    w = kv_b_proj_weight(rng, d)
    bad_w = {"shape": w[:-1], "dtype": w.astype(np.float16),
             "strided": np.concatenate([w, w], axis=1)[:, ::2], "none": None}[bad]
    with raises_naming("kv_b_proj"):
        layer.process_weights_after_loading(bad_w)


def test_batch_not_ordered_decodes_first_is_an_error(rng):
    layer = pagedattn.MLAAttention(4, None, 32, 16, 48, None, 64, block_size=16, dtype="float32")
    batch = make_batch(rng, [5, 1], [0, 9], 16, 1, 80, head_size_v=1)
    with pytest.raises(pagedattn.Error) as info:
        layer.metadata_builder().build(batch.common())
    assert "decode" in str(info.value)


@pytest.mark.parametrize("bad, argument", [
    ("kv_c_dtype", "kv_c"), ("k_pe_dtype", "k_pe"), ("k_pe_rows", "k_pe"),
    ("cache_shape", "kv_cache"), ("cache_dtype", "kv_cache"),
    ("slot_range", "slot_mapping"), ("slot_dtype", "slot_mapping"), ("scale", "scale"),
    ("kv_cache_dtype", "kv_cache_dtype"),
])
def test_concat_and_cache_mla_rejects_bad_arguments(rng, bad, argument):
    L, R, bs = 64, 16, 16
    kv_c = rng.standard_normal((4, L)).astype(np.float32)
    k_pe = rng.standard_normal((4, R)).astype(np.float32)
    cache = np.full((2, bs, L + R), np.nan, np.float32)
    slots = np.array([0, 5, 17, -1], np.int64)
    args = dict(kv_c=kv_c, k_pe=k_pe, kv_cache=cache, slot_mapping=slots, kv_cache_dtype="auto")
    if bad == "kv_c_dtype":
        args["kv_c"] = kv_c.astype(np.float64)
    elif bad == "k_pe_dtype":
        args["k_pe"] = k_pe.astype(np.float16)
    elif bad == "k_pe_rows":
        args["k_pe"] = k_pe[:3]
    elif bad == "cache_shape":
        args["kv_cache"] = np.full((2, bs, L + R + 1), np.nan, np.float32)
    elif bad == "cache_dtype":
        args["kv_cache"] = np.full((2, bs, L + R), np.nan, np.float16)
    elif bad == "slot_range":
        args["slot_mapping"] = np.array([0, 5, 2 * bs, -1], np.int64)
    elif bad == "slot_dtype":
        args["slot_mapping"] = slots.astype(np.int32)
    elif bad == "scale":
        args["scale"] = np.array([1.0, 2.0], np.float32)
    elif bad == "kv_cache_dtype":
        args["kv_cache_dtype"] = "int4"
    with raises_naming(argument):
        pagedattn.concat_and_cache_mla(**args)
    assert np.isnan(cache).all()


@pytest.mark.parametrize("bad, argument", [
    ("dst_dtype", "dst"), ("dst_rows", "cu_seq_lens"), ("cu_dtype", "cu_seq_lens"),
    ("cu_length", "cu_seq_lens"), ("block_range", "block_table"), ("batch_size", "batch_size"),
    ("too_many_requests", "block_table"), ("cache_dtype", "src_cache"),
])
def test_gather_rejects_bad_arguments(rng, bad, argument):
    L, R, bs = 64, 16, 16
    cache = rng.standard_normal((3, bs, L + R)).astype(np.float32)
    dst = np.full((20, L + R), np.nan, np.float32)
    table = np.array([[0, 1], [2, 0]], np.int32)
    cu = np.array([0, 12, 20], np.int32)
    args = dict(src_cache=cache, dst=dst, block_table=table, cu_seq_lens=cu, batch_size=2)
    if bad == "dst_dtype":
        args["dst"] = np.zeros((20, L + R), np.int32)
    elif bad == "dst_rows":
        args["dst"] = np.zeros((19, L + R), np.float32)
    elif bad == "cu_dtype":
        args["cu_seq_lens"] = cu.astype(np.int64)
    elif bad == "cu_length":
        args["cu_seq_lens"] = cu[:2]
    elif bad == "block_range":
        args["block_table"] = np.array([[7, 1], [2, 0]], np.int32)  # column 0 is read
    elif bad == "batch_size":
        args["batch_size"] = -1
    elif bad == "too_many_requests":
        args["batch_size"] = 3
    elif bad == "cache_dtype":
        args["src_cache"] = cache.astype(np.float16)
    with raises_naming(argument):
        pagedattn.gather_and_maybe_dequant_cache(**args)
    assert np.isnan(dst).all()


def test_signatures_follow_vllm():
    import inspect

    assert list(inspect.signature(pagedattn.MLAAttention).parameters)[:8] == [
        "num_heads", "scale", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "q_lora_rank", "kv_lora_rank", "kv_b_proj"]
    assert list(inspect.signature(pagedattn.MLAAttention.forward).parameters)[1:8] == [
        "q", "kv_c_normed", "k_pe", "kv_cache", "attn_metadata", "output", "output_lse"]
    assert list(inspect.signature(pagedattn.concat_and_cache_mla).parameters) == [
        "kv_c", "k_pe", "kv_cache", "slot_mapping", "kv_cache_dtype", "scale"]
    assert list(inspect.signature(pagedattn.gather_and_maybe_dequant_cache).parameters) == [
        "src_cache", "dst", "block_table", "cu_seq_lens", "batch_size", "kv_cache_dtype",
        "scale", "seq_starts"]


def test_kv_b_proj_module_with_a_weight_attribute(rng):
    """kv_b_proj may be a module (torch.nn.Linear, vLLM's ColumnParallelLinear): its .weight."""
    class Linear:
        def __init__(self, weight):
            self.weight = weight

    d = CPU_DIMS
    weight = kv_b_proj_weight(rng, d)
    layer = pagedattn.MLAAttention(4, None, 32, 16, 48, None, 64, Linear(weight), block_size=16,
                                   dtype="float32")
    fw = make_numpy()
    step = MLAStep(fw, rng, layer, query_lens=[1, 3], context_lens=[5, 2])
    cache = step.cache()
    md = layer.metadata_builder().build(step.common())
    out = layer.forward(step.q, step.kv_c, step.k_pe, cache, md)
    ref, _ = mla_oracle(step, weight, fw.host(cache), md.num_decodes)
    assert rel_err(out, ref) <= TOLERANCE["float32"]
