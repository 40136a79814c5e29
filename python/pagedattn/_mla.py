"""pagedattn.MLAAttention: multi-head latent attention (vLLM's vllm.attention.layer.MLAAttention)."""

from __future__ import annotations

from typing import Any, Optional

from . import _C
from . import _tensors


def _weight(kv_b_proj: Any) -> Any:
    """The weight tensor of `kv_b_proj`: a tensor as is, a module (torch.nn.Linear, vLLM's
    ColumnParallelLinear) through ``.weight``; parameters are detached (DLPack refuses tensors
    that require grad). No copy."""
    if kv_b_proj is None:
        raise _tensors.error("kv_b_proj", "kv_b_proj is None: expected the kv_b_proj weight "
                             "(num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank)")
    if not hasattr(kv_b_proj, "shape") and hasattr(kv_b_proj, "weight"):
        kv_b_proj = kv_b_proj.weight
    if _tensors.is_torch_tensor(kv_b_proj) and kv_b_proj.requires_grad:
        kv_b_proj = kv_b_proj.detach()
    return kv_b_proj


class MLAAttention(_C._MLAAttention):
    """One MLA layer (DeepSeek-V2/V3, Kimi-K2): selects an MLA backend, owns its kernels, writes
    its paged latent cache and attends (vLLM's ``MLAAttention``; argument names as there).

    Names: ``H`` = num_heads, ``L`` = kv_lora_rank, ``R`` = qk_rope_head_dim, ``P`` =
    qk_nope_head_dim, ``V`` = v_head_dim. The cache holds one latent row ``[kv_c_normed (L),
    k_pe (R)]`` per token. Per head ``h`` the layer computes (un-absorbed form)
    ``k = [kv_c . W_UK[h]^T, k_pe]``, ``v = kv_c . W_UV[h]^T`` and causal attention of
    ``q[:, h]`` (``P + R``) over the request's keys (context and new tokens); decode tokens run
    the absorbed form (the same function, reassociated).

    Arguments:
        num_heads: query heads ``H`` (of this tensor-parallel rank).
        scale: softmax scale of ``q . k`` (DeepSeek: ``qk_head_dim ** -0.5 * mscale ** 2``);
            None = ``(P + R) ** -0.5``.
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: ``P``, ``R``, ``V``.
        q_lora_rank: recorded (the q projection is the caller's); None when q is not low-rank.
        kv_lora_rank: ``L``.
        kv_b_proj: the kv_b_proj weight ``(H * (P + V), L)`` (a Linear's ``(out, in)``: rows
            ``h * (P + V) + i`` are ``W_UK[h][i]`` for ``i < P``, then ``W_UV[h][i - P]``), in
            the layer's ``dtype``, on its device, contiguous -- or a module with ``.weight``
            (``torch.nn.Linear``). When given, the constructor runs
            ``process_weights_after_loading`` on it at once (so a layer built from loaded weights
            is ready); None = call ``process_weights_after_loading(kv_b_proj)`` before the first
            forward. The weight is split into the impl's own copies; the tensor is kept only so
            that a later ``process_weights_after_loading()`` can re-read it (vLLM's order:
            build the layer, load the weights in place, then process them).
        kv_cache_dtype: "auto" (cache in ``dtype``), "fp8" (= "fp8_e4m3"), "fp8_e5m2",
            "bfloat16", "float16" or "float32". fp8 stores ``saturate(x / k_scale)``.
        block_size: tokens per cache block (CUDA_MLA and CPU_MLA need multiples of 16).
        kv_sharing_target_layer_name: an earlier layer whose cache this layer reads (never
            writes); needs ``static_forward_context``, which checks it (as ``Attention``).
        prefix: this layer's name, e.g. "model.layers.0.self_attn.attn".
        dtype: activation dtype of q, kv_c_normed, k_pe, kv_b_proj and the output.
        device: "cpu" or "cuda" (or "cuda:0", a torch.device).
        backend: force an MLA backend by name ("CUDA_MLA", "CPU_MLA", "REFERENCE_MLA"); None =
            the selector's choice (env ``PAGEDATTN_BACKEND`` also forces one).
        prefill_backend: force an MLA prefill backend by name (``list_mla_prefill_backends()``);
            None = ``get_mla_prefill_backend``'s choice (env ``PAGEDATTN_MLA_PREFILL_BACKEND``).
        static_forward_context: the model's ``StaticForwardContext``: the layer registers itself
            there and its sharing target is checked against it (see ``Attention``).
        fp8_output: the layer's forwards will pass ``output_scale`` (fused fp8 e4m3 output,
            ``output = attention / output_scale``): the selector takes only a backend that
            supports it (CUDA_MLA, REFERENCE_MLA; CPU_MLA does not); a forced backend without it
            raises.
        calculate_kv_scales: measure ``k_scale`` from the first batch written into an fp8 cache,
            ``amax(|kv_c_normed|, |k_pe|) / fp8 max`` over the rows it stores (``kv_scales_pending``
            until then; see ``Attention``).
        dcp_world_size, dcp_rank, cp_kv_cache_interleave_size: the decode-context-parallel group
            (see ``Attention``); run its steps through ``pagedattn.dcp_forward``.

    Attributes:
        backend: the selected ``AttentionBackend``; prefill_backend: the prefill backend's name;
        kv_cache_spec: the ``KVCacheSpec`` (kind "mla"); k_scale: the fp8 cache scale (float).

    Typical use (one step; the batch lists decodes first, see ``reorder_batch``)::

        layer = pagedattn.MLAAttention(16, None, 128, 64, 128, 1536, 512, kv_b_proj_weight,
                                       dtype="bfloat16")
        kv_cache = layer.allocate_kv_cache(num_blocks=64)       # (64, 64, 576)
        builder = layer.metadata_builder()
        md = builder.build(pagedattn.CommonAttentionMetadata(query_start_loc, seq_lens,
                                                             block_table, slot_mapping))
        out = layer.forward(q, kv_c_normed, k_pe, kv_cache, md)  # (T, H, V)

    Errors raise ``pagedattn.Error``, a ``ValueError`` whose message names the argument; nothing
    is written when an argument is rejected.
    """

    def __init__(
        self,
        num_heads: int,
        scale: Optional[float],
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: Optional[int],
        kv_lora_rank: int,
        kv_b_proj: Any = None,
        kv_cache_dtype: str = "auto",
        block_size: int = 64,
        kv_sharing_target_layer_name: Optional[str] = None,
        prefix: str = "",
        dtype: Any = "bfloat16",
        device: Any = "cpu",
        backend: Optional[str] = None,
        prefill_backend: Optional[str] = None,
        *,
        static_forward_context: Optional[_C.StaticForwardContext] = None,
        fp8_output: bool = False,
        calculate_kv_scales: bool = False,
        dcp_world_size: int = 1,
        dcp_rank: int = 0,
        cp_kv_cache_interleave_size: int = 1,
    ) -> None:
        super().__init__(
            _tensors.int32_arg(num_heads, "num_heads"),
            None if scale is None else float(scale),
            _tensors.int32_arg(qk_nope_head_dim, "qk_nope_head_dim"),
            _tensors.int32_arg(qk_rope_head_dim, "qk_rope_head_dim"),
            _tensors.int32_arg(v_head_dim, "v_head_dim"),
            None if q_lora_rank is None else _tensors.int32_arg(q_lora_rank, "q_lora_rank"),
            _tensors.int32_arg(kv_lora_rank, "kv_lora_rank"),
            str(kv_cache_dtype),
            _tensors.int32_arg(block_size, "block_size"),
            kv_sharing_target_layer_name,
            str(prefix),
            dtype,
            device,
            backend,
            prefill_backend,
            static_forward_context,
            bool(fp8_output),
            bool(calculate_kv_scales),
            _tensors.int32_arg(dcp_world_size, "dcp_world_size"),
            _tensors.int32_arg(dcp_rank, "dcp_rank"),
            _tensors.int32_arg(cp_kv_cache_interleave_size, "cp_kv_cache_interleave_size"),
        )
        self._kv_b_proj = None
        if kv_b_proj is not None:
            self.process_weights_after_loading(kv_b_proj)

    def process_weights_after_loading(self, kv_b_proj: Any = None) -> None:
        """Splits the kv_b_proj weight ``(H * (P + V), L)`` into this layer's W_UK / W_UV (exact
        copies; the decode's absorbed products and the prefill's up-projection use them).

        kv_b_proj: the weight (or a module with ``.weight``); None = the one given to the
        constructor or to the previous call, re-read now (after its values were loaded in
        place). Must have run before ``forward``; calling it again replaces the weights.
        """
        if kv_b_proj is None:
            kv_b_proj = self._kv_b_proj
            if kv_b_proj is None:
                raise _tensors.error("kv_b_proj", "kv_b_proj is None and none was given before: "
                                     "pass the kv_b_proj weight (num_heads * (qk_nope_head_dim "
                                     "+ v_head_dim), kv_lora_rank)")
        weight = _weight(kv_b_proj)
        _tensors.use_stream_of(weight)
        self._process_weights_after_loading(weight)
        self._kv_b_proj = kv_b_proj

    def allocate_kv_cache(self, num_blocks: int, framework: Optional[str] = None) -> Any:
        """Allocates this layer's paged latent cache ``(num_blocks, block_size, L + R)``, filled
        with zeros, in the storage dtype (``kv_cache_storage_dtype``: e.g. bfloat16, or
        float8_e4m3fn for "fp8"). Row ``[:L]`` holds kv_c_normed, ``[L:]`` k_pe.

        framework: "numpy" or "torch"; None = NumPy for device "cpu", torch for "cuda".
        """
        array, dtype = self._allocate_kv_cache(int(num_blocks))
        return _tensors.cache_in_framework(array, dtype, self.device, framework)

    def metadata_builder(
        self,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        max_model_len: int = 8192,
        chunked_prefill_workspace_tokens: Optional[int] = None,
        *,
        batch_invariant: bool = False,
        num_speculative_tokens: int = 0,
    ) -> _C.AttentionMetadataBuilder:
        """A metadata builder for this layer's KV-cache group (vLLM's MLACommonMetadataBuilder).
        ``build(common)`` returns an ``MLAAttentionMetadata``; the batch must list its decodes
        (one new token each, up to 1 + num_speculative_tokens) first:
        ``reorder_batch(num_scheduled_tokens)`` gives the order.

        chunked_prefill_workspace_tokens: rows of the workspace the prefills' cached context is
        gathered into, per chunk (must be >= max_num_seqs * block_size); None = vLLM's rule
        ``mla_chunked_prefill_workspace_tokens(max_model_len, max_num_seqs, block_size)``. A
        context longer than the workspace is processed in several chunks merged by LSE. The
        builder's workspace is sized once from these limits: a batch beyond them is an error.

        batch_invariant: plans whose output bits for a request do not depend on the rest of the
        batch (fixed context chunks and split sizes; env PAGEDATTN_BATCH_INVARIANT=1 turns it on
        for every builder).

        num_speculative_tokens: vLLM's speculative_config (checked >= 0): k > 0 makes a request of
        up to 1 + k tokens a decode (reorder_batch_threshold = 1 + k), run in the absorbed form,
        each token attending causally to the cache and its request's earlier tokens.
        """
        w = 0 if chunked_prefill_workspace_tokens is None else int(chunked_prefill_workspace_tokens)
        if chunked_prefill_workspace_tokens is not None and w <= 0:
            raise _tensors.error("chunked_prefill_workspace_tokens",
                                 f"chunked_prefill_workspace_tokens = {w}: expected > 0 (or None "
                                 "= vLLM's rule)")
        i32 = _tensors.int32_arg
        return self._metadata_builder(i32(max_num_seqs, "max_num_seqs"),
                                      i32(max_num_batched_tokens, "max_num_batched_tokens"),
                                      i32(max_model_len, "max_model_len"), w, bool(batch_invariant),
                                      i32(num_speculative_tokens, "num_speculative_tokens"))

    def forward(
        self,
        q: Any,
        kv_c_normed: Any,
        k_pe: Any,
        kv_cache: Any,
        attn_metadata: _C.AttentionMetadata,
        output: Any = None,
        output_lse: Any = None,
        return_lse: bool = False,
        output_scale: Any = None,
    ) -> Any:
        """Writes ``[kv_c_normed, k_pe]`` into ``kv_cache`` at ``attn_metadata``'s slot mapping
        (unless this layer shares another layer's cache), then attends.

        q: ``(T, H, P + R)`` (``[q_nope, q_pe]`` with RoPE applied); kv_c_normed: ``(T, L)``;
        k_pe: ``(T, R)`` or ``(T, 1, R)``; all in the layer's ``dtype`` and on its device.
        kv_cache: from ``allocate_kv_cache``. attn_metadata: ``metadata_builder().build(common)``.
        output: optional ``(T, H, V)`` or ``(T, H * V)`` buffer written in place (the same
        object is returned); None allocates ``(T, H, V)`` beside ``q``.
        output_lse: optional float32 ``(H, T)`` buffer for the log-sum-exp (natural log) of
        every row; return_lse=True allocates one. With either, returns ``(output, lse)``.
        output_scale: float32 ``(1,)`` tensor on the layer's device: write an fp8_e4m3 output
        ``saturate(o / scale)`` (only backends with the "fp8_output" feature; the output, given
        or allocated, is then float8_e4m3fn). On CUDA the scale is read on the device: one that is
        not positive and finite writes NaN; on the CPU it raises.

        Only the first ``attn_metadata.num_actual_tokens`` rows are defined (the rest padding).
        With an fp8 cache, decode tokens read every key from the cache (quantized, their own
        too) while prefill tokens attend over kv_c_normed / k_pe as given, as vLLM.
        """
        if not isinstance(attn_metadata, _C.MLAAttentionMetadata):
            what = "None" if attn_metadata is None else f"a {type(attn_metadata).__name__}"
            raise _tensors.error("attn_metadata", f"attn_metadata is {what}: expected the "
                                 "MLAAttentionMetadata of this layer's metadata_builder().build(common)")
        t = _tensors.num_tokens(q, "q")
        if output is None:
            dtype = "float8_e4m3fn" if output_scale is not None else self.dtype
            output = _tensors.empty_like(q, (t, self.num_heads, self.v_head_dim), dtype, "q")
        lse = output_lse
        if lse is None and return_lse:
            lse = _tensors.empty_like(q, (self.num_heads, t), "float32", "q")
        _tensors.use_stream_of(q)
        self._forward(q, kv_c_normed, k_pe, kv_cache, attn_metadata, output, lse, output_scale)
        return (output, lse) if lse is not None else output

    def __repr__(self) -> str:
        return (f"pagedattn.MLAAttention(num_heads={self.num_heads}, "
                f"kv_lora_rank={self.kv_lora_rank}, qk_nope_head_dim={self.qk_nope_head_dim}, "
                f"qk_rope_head_dim={self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}, "
                f"dtype={self.dtype!r}, device={self.device!r}, backend={self.backend.name!r}, "
                f"prefill_backend={self.prefill_backend!r}, prefix={self.layer_name!r})")
