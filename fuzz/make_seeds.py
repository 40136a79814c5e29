#!/usr/bin/env python3
"""Writes the seed corpora in fuzz/corpus/<target>/: a few VALID inputs per target, encoded in
the byte order the targets decode (fuzz_input.h ByteReader: front to back, one byte per small
value, `small(lo, hi)` = lo + byte % (hi - lo + 1); an exhausted input reads as zeros, so the
trailing zero bytes are left out). Rerun after changing a target's decoding:

    python3 fuzz/make_seeds.py

Files named regression-* in the corpora are inputs that once failed (kept as corpus entries: after a
change of decoding they may no longer reproduce; the regression tests live in tests/ and python/)."""

from __future__ import annotations

import os

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")


def write(target: str, name: str, data: bytes) -> None:
    os.makedirs(os.path.join(ROOT, target), exist_ok=True)
    with open(os.path.join(ROOT, target, name), "wb") as f:
        f.write(data)


def batch(query_lens, context_lens, rotate=0, shared=0, pad=0) -> list[int]:
    """fuzz_batch.h decode_batch: n, causal, (q, ctx) per request, rotate, shared prefix columns
    (0-3, capped by the contexts), slot padding, no corruption."""
    out = [len(query_lens), 0]
    for q, c in zip(query_lens, context_lens):
        out += [q, c]
    return out + [rotate, 0xC0 + shared if shared else 0, pad, 0]


# ---- fuzz_common_metadata --------------------------------------------------------------------
# validate: [0, block_size - 1, num_blocks - 1, batch..., device, 7 layout bytes, which, threshold, flag]
write("fuzz_common_metadata", "validate-mixed",
      bytes([0, 3, 15] + batch([3, 1, 7, 1], [7, 4, 0, 19], rotate=5) + [0] * 8 + [0, 1, 0]))
write("fuzz_common_metadata", "validate-decodes-no-cache-size",
      bytes([0, 1, 7] + batch([1, 1, 1], [9, 2, 30]) + [0] * 8 + [0x80, 2, 1]))
write("fuzz_common_metadata", "validate-empty", bytes([0, 0, 0, 0, 0]))
# make: [1, block_size - 1, num_blocks - 1, batch..., reqs_padded?, tokens_padded?, cols?, clear?, which]
write("fuzz_common_metadata", "make-padded",
      bytes([1, 3, 11] + batch([2, 5], [6, 0], rotate=3, pad=2) + [0xC0, 4, 0xC0, 20, 0, 0, 0, 3, 1]))
write("fuzz_common_metadata", "validate-shared-prefix",
      bytes([0, 3, 15] + batch([1, 2, 1], [9, 12, 8], shared=2) + [0] * 8 + [0, 1, 0]))
write("fuzz_common_metadata", "make-plain", bytes([1, 15 % 8, 23] + batch([1, 12, 4], [40, 0, 3])))

# ---- fuzz_local_attention --------------------------------------------------------------------
# [0, block_size - 1, 0, chunk / block_size - 1, n, query_start_loc[0] = 0, (q, seq - q)..., sizes, spare cols]
def local(block_size, multiple, query_lens, seq_lens, spare=1) -> bytes:
    out = [0, block_size - 1, 0, multiple - 1, len(query_lens), 0]
    for q, s in zip(query_lens, seq_lens):
        out += [q, s - q]
    return bytes(out + [0, spare])


write("fuzz_local_attention", "reference-example", local(2, 2, [4, 10, 5], [6, 17, 9]))
write("fuzz_local_attention", "decode-and-empty-query", local(2, 2, [1, 0], [13, 6]))
write("fuzz_local_attention", "chunk-equals-block", local(4, 1, [3, 8, 1], [11, 8, 20], spare=0))
write("fuzz_local_attention", "long-chunk", local(1, 6, [24, 2], [48, 50], spare=2))


# ---- fuzz_builders ---------------------------------------------------------------------------
def standard(backend, kv_heads=2, group=2, head16=2, dtype=0, cache_dtype=0, log2_block=2,
             attn_type=0, features=0, extra=(), num_blocks=16, q=(3, 1), ctx=(5, 9), fp8_out=False,
             lse=True, shared=0) -> bytes:
    """Kind 0 (CPU) / 1 (REFERENCE). dtype: 0 f32, 1 f16, 2 bf16. cache_dtype: index into
    kCacheDtypes (0 auto, 2 fp8, 3 fp8_e5m2, 4 bfloat16). attn_type: 0 decoder, 5 encoder,
    6 encoder_only, 7 encoder_decoder. features: 1 window, 2 soft cap, 4 ALiBi, 8 sinks, 16 HND;
    `extra` are the feature bytes (window, soft cap, one sink byte per head)."""
    out = [backend, kv_heads - 1, group - 1, 0, head16 - 1, 0, dtype, cache_dtype, 0, log2_block,
           attn_type, features, *extra]
    out += [7, 0]           # max_num_seqs 8, max_num_batched_tokens 64
    out += [0, 0, 0]        # k_scale 1, v_scale 1, no per-head scales
    out += [num_blocks - 1]
    if attn_type in (5, 6):
        out += [0]          # encoder: no context
    out += batch(list(q), list(ctx), rotate=1, shared=shared)
    # no layout perturbation, common_prefix_len = the shared blocks (cascade), fast_build off,
    # full cache
    out += [0] + ([0xC0, shared] if shared else [0]) + [0, 0]
    out += [0, 0]           # fill seed, rows = num_actual_tokens
    if attn_type == 7:
        out += [0]          # key/value given
    out += [0xE0, 0] if fp8_out else [0]
    out += [1 if lse else 0]
    return bytes(out)


def mla(backend, heads=2, lora16=2, nope8=1, v8=2, dtype=0, cache_dtype=0, block16=1,
        num_blocks=12, q=(1, 1, 6), ctx=(20, 3, 9), max_num_seqs=8, workspace=None,
        lse=True) -> bytes:
    """Kind 2 (CPU_MLA) / 3 (REFERENCE_MLA); decodes first; contexts up to 100. workspace: the
    chunked-prefill workspace as a multiple (1-3) of max_num_seqs * block_size, to run long
    contexts in several chunks; None = vLLM's rule."""
    out = [backend, heads - 1, 0, lora16 - 1, nope8 - 1, v8 - 1, dtype, cache_dtype, 0, block16 - 1]
    out += [0, max_num_seqs - 1]                      # fill seed, max_num_seqs
    out += [0xC0, workspace - 1] if workspace else [0]
    out += [0]                                        # k_scale 1
    out += [num_blocks - 1] + batch(list(q), list(ctx), rotate=2)
    out += [0, 0, 0, 0, 0]                            # decodes first, no perturbation, prefix 0, fast off, full cache
    out += [0, 0, 1 if lse else 0]                    # rows, k_pe (T, R), lse
    return bytes(out)


write("fuzz_builders", "cpu-gqa-f32", standard(0))
write("fuzz_builders", "cpu-bf16-fp8-window-sinks-hnd",
      standard(0, dtype=2, cache_dtype=2, features=1 | 8 | 16, extra=(6, 1, 3, 2, 4), q=(1, 6, 2),
               ctx=(30, 0, 11)))
write("fuzz_builders", "cpu-f16-softcap-alibi-fp8-out",
      standard(0, dtype=1, features=2 | 4, extra=(2,), fp8_out=True, log2_block=4))
write("fuzz_builders", "cpu-cascade-shared-prefix",
      standard(0, q=(1, 4, 2), ctx=(9, 12, 8), shared=2, num_blocks=20))
write("fuzz_builders", "reference-cascade-shared-prefix",
      standard(1, q=(2, 1), ctx=(8, 10), shared=1, log2_block=3))
write("fuzz_builders", "cpu-encoder-only", standard(0, attn_type=6, q=(4, 2), ctx=(0, 0)))
write("fuzz_builders", "reference-cross", standard(1, attn_type=7, q=(2, 3), ctx=(4, 0)))
write("fuzz_builders", "reference-e5m2-sinks", standard(1, cache_dtype=3, features=8, extra=(0, 1, 2, 3)))
write("fuzz_builders", "cpu-mla-f32", mla(2))
write("fuzz_builders", "cpu-mla-bf16-chunked-context",
      mla(2, dtype=2, max_num_seqs=3, workspace=1, ctx=(20, 40, 90), num_blocks=24))
write("fuzz_builders", "reference-mla-fp8", mla(3, cache_dtype=2, lora16=1))

# ---- fuzz_cli --------------------------------------------------------------------------------
def cli(*args: str) -> bytes:
    return "\n".join(args).encode()


write("fuzz_cli", "backends-default", cli("backends"))
write("fuzz_cli", "backends-flags", cli("backends", "--head-size", "64", "--dtype", "float16",
                                        "--kv-cache-dtype", "fp8", "--window", "128", "--sinks"))
write("fuzz_cli", "backends-preset", cli("backends", "--preset", "gemma2-9b"))
write("fuzz_cli", "run-workload", cli("run", "--preset", "tiny", "--num-requests", "4", "--prompt-len",
                                      "uniform:8:64", "--output-len", "lognormal:16:8:64", "--no-check"))
write("fuzz_cli", "run-budget", cli("run", "--max-num-batched-tokens", "256", "--block-size", "32",
                                    "--num-blocks", "40", "--dtype", "bfloat16", "--quiet"))
write("fuzz_cli", "check-help", cli("check", "--help"))
