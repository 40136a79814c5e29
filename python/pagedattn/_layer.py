"""pagedattn.Attention: the attention layer (vLLM's vllm.attention.layer.Attention)."""

from __future__ import annotations

from typing import Any, Optional

from . import _C
from . import _tensors


class Attention(_C._Attention):
    """One attention layer: selects a backend, owns its kernels, writes its paged KV cache and
    attends (vLLM's ``Attention``; keyword names as there).

    Arguments:
        num_heads: number of query heads ``Hq``.
        head_size: size ``D`` of each query/key head.
        scale: softmax scale applied to ``q . k``, > 0; None means ``head_size ** -0.5``
            (0 is an error, not "default").
        num_kv_heads: number of key/value heads ``Hkv`` (GQA/MQA), > 0; None means ``num_heads``.
            ``num_heads`` must be a multiple of it; query head ``h`` reads KV head
            ``h // (num_heads // num_kv_heads)``.
        alibi_slopes: one ALiBi slope per query head (list, NumPy array or tensor), or None.
            The logit of query position ``i`` and key position ``j`` gets ``-slope * |i - j|``.
        sliding_window: window ``W``: a query at position ``p`` sees keys in
            ``[p - (W - 1), p]`` (decoder); None = unlimited.
        logits_soft_cap: soft cap ``c``: logits become ``c * tanh(s / c)`` (before ALiBi and
            the mask); None = off.
        attn_type: ``AttentionType.DECODER`` ("decoder": causal over the paged cache),
            ``ENCODER`` / ``ENCODER_ONLY`` (non-causal over the current tokens, no cache) or
            ``ENCODER_DECODER`` (cross-attention over cached encoder K/V).
        kv_cache_dtype: "auto" (cache in ``dtype``), "fp8" (= "fp8_e4m3"), "fp8_e5m2",
            "bfloat16", "float16" or "float32". fp8 stores ``saturate(x / k_scale)``.
        block_size: tokens per KV-cache block (page).
        sinks: one attention-sink logit per query head (added to the softmax denominator
            only), or None.
        kv_sharing_target_layer_name: name of an earlier layer whose cache this layer reads;
            such a layer never writes a cache (pass key=value=None and that layer's cache). It
            needs ``static_forward_context``, which checks the target when this layer is made.
        prefix: this layer's name, e.g. "model.layers.0.self_attn.attn".
        dtype: activation dtype of query/key/value/output: "bfloat16" (default),
            "float16", "float32", or a NumPy / ml_dtypes / torch dtype.
        device: "cpu" or "cuda" (or "cuda:0", a torch.device).
        backend: force a backend by name (see ``list_backends()``); None = the selector's
            choice (env ``PAGEDATTN_BACKEND`` also forces one). A backend that cannot run this
            configuration raises pagedattn.Error listing its reasons.
        head_size_v: value head size ``Dv`` when it differs from ``head_size`` (MLA-style).
        attention_chunk_size: chunked local attention (Llama 4) chunk ``C``, or None: a query at
            position ``p`` sees the keys ``k <= p`` with ``k // C == p // C``. ``C`` must be a
            multiple of ``block_size``. The layer's ``metadata_builder()`` plans vLLM's virtual
            batches for it (no cascade, no CUDA graphs).
        static_forward_context: the model's ``StaticForwardContext`` (vLLM's static forward
            context): the layer registers itself there under ``prefix`` (a duplicate name is an
            error), and its ``kv_sharing_target_layer_name`` must be a layer created before it
            there, reading its own cache, with the same attention type, device and KV-cache
            spec. None = not registered (then the layer cannot share a cache).
        calculate_kv_scales: vLLM's option: the first batch this layer writes into its fp8
            cache sets ``k_scale = amax(|key|) / fp8_max`` and ``v_scale = amax(|value|) /
            fp8_max`` (fp8_max 448 for "fp8" / "fp8_e4m3", 57344 for "fp8_e5m2"), measured over
            the rows it writes (slot -1 rows are not), before writing them; later batches never
            change them. A scale whose batch is all zeros keeps its value and is measured from the
            next nonzero batch (``kv_scales_pending`` says whether one still waits). With a
            16-bit cache, or a layer without a cache, it does nothing (as vLLM allows it for any
            cache). A NaN / inf in the measured keys or values raises ``pagedattn.Error``
            (nothing written); so does ``kv_sharing_target_layer_name`` (at construction: the
            layer must use its target's scales). On CUDA the measuring forward waits for the
            stream once (vLLM's ``.item()``): run it outside CUDA-graph capture.
        fp8_output: the layer's forwards will pass ``output_scale`` (fused fp8 e4m3 output,
            ``output = attention / output_scale``): the selector takes only a backend that
            supports it (CPU, CUDA, REFERENCE); a forced backend without it raises.
        dcp_world_size, dcp_rank, cp_kv_cache_interleave_size: the decode-context-parallel group
            this layer runs in (vLLM's names): global token ``t`` of a request lives on rank
            ``(t // cp_kv_cache_interleave_size) % dcp_world_size`` (the interleave must divide
            ``block_size``). With ``dcp_world_size > 1`` run the layer's steps through
            ``pagedattn.dcp_forward`` (``need_to_return_lse_for_decode`` is then True).

    Attributes:
        backend: the selected ``AttentionBackend`` (``.name``, ``.get_kv_cache_shape()``...).
        kv_cache_spec: the ``KVCacheSpec`` of this layer's cache.
        q_scale, k_scale, v_scale: per-tensor quantization scales (floats, default 1.0).
        kv_scales_pending: True while ``calculate_kv_scales`` still has a scale to measure.

    Typical use (one step)::

        layer = pagedattn.Attention(8, 64, 64 ** -0.5, num_kv_heads=2, dtype="float32")
        kv_cache = layer.allocate_kv_cache(num_blocks=32)
        builder = layer.metadata_builder()
        common = pagedattn.CommonAttentionMetadata(query_start_loc, seq_lens, block_table,
                                                   slot_mapping)
        out = layer.forward(q, k, v, kv_cache, builder.build(common))

    Errors (wrong dtype, device, shape, strides, inconsistent metadata, out-of-range slots)
    raise ``pagedattn.Error``, a ``ValueError`` whose message names the argument; nothing is
    written when an argument is rejected.
    """

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: Optional[float],
        num_kv_heads: Optional[int] = None,
        alibi_slopes: Any = None,
        sliding_window: Optional[int] = None,
        logits_soft_cap: Optional[float] = None,
        attn_type: str = "decoder",
        kv_cache_dtype: str = "auto",
        block_size: int = 16,
        sinks: Any = None,
        kv_sharing_target_layer_name: Optional[str] = None,
        prefix: str = "",
        dtype: Any = "bfloat16",
        device: Any = "cpu",
        backend: Optional[str] = None,
        *,
        head_size_v: Optional[int] = None,
        attention_chunk_size: Optional[int] = None,
        static_forward_context: Optional[_C.StaticForwardContext] = None,
        calculate_kv_scales: bool = False,
        fp8_output: bool = False,
        dcp_world_size: int = 1,
        dcp_rank: int = 0,
        cp_kv_cache_interleave_size: int = 1,
    ) -> None:
        i32 = _tensors.int32_arg
        super().__init__(
            i32(num_heads, "num_heads"),
            i32(head_size, "head_size"),
            None if scale is None else float(scale),
            None if num_kv_heads is None else i32(num_kv_heads, "num_kv_heads"),
            _tensors.float_list(alibi_slopes, "alibi_slopes"),
            None if sliding_window is None else i32(sliding_window, "sliding_window"),
            None if logits_soft_cap is None else float(logits_soft_cap),
            str(attn_type),
            str(kv_cache_dtype),
            i32(block_size, "block_size"),
            _tensors.float_list(sinks, "sinks"),
            kv_sharing_target_layer_name,
            str(prefix),
            dtype,
            device,
            backend,
            None if head_size_v is None else i32(head_size_v, "head_size_v"),
            None if attention_chunk_size is None
            else i32(attention_chunk_size, "attention_chunk_size"),
            static_forward_context,
            bool(calculate_kv_scales),
            bool(fp8_output),
            i32(dcp_world_size, "dcp_world_size"),
            i32(dcp_rank, "dcp_rank"),
            i32(cp_kv_cache_interleave_size, "cp_kv_cache_interleave_size"),
        )

    def allocate_kv_cache(self, num_blocks: int, framework: Optional[str] = None) -> Any:
        """Allocates this layer's paged KV cache, filled with zeros.

        Shape (logical order) ``backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads,
        head_size)``, normally ``(2, num_blocks, block_size, num_kv_heads, head_size)`` with
        ``[0]`` = keys and ``[1]`` = values, stored contiguously in the backend's
        ``get_kv_cache_stride_order()`` (so an HND cache is a permuted view). The dtype is the
        storage dtype (``kv_cache_storage_dtype``: e.g. bfloat16, or float8_e4m3fn for "fp8").

        framework: "numpy" or "torch"; None = NumPy for device "cpu", torch for "cuda".
        The returned array owns the memory and exports DLPack.
        """
        array, dtype = self._allocate_kv_cache(int(num_blocks))
        return _tensors.cache_in_framework(array, dtype, self.device, framework)

    def forward(
        self,
        query: Any,
        key: Any,
        value: Any,
        kv_cache: Any,
        attn_metadata: _C.AttentionMetadata,
        output: Any = None,
        return_lse: bool = False,
        output_scale: Any = None,
    ) -> Any:
        """Writes ``key``/``value`` into ``kv_cache`` at ``attn_metadata``'s slot mapping (unless
        this layer shares another layer's cache), then attends.

        query: ``(T, Hq, D)``; key, value: ``(T, Hkv, D)`` / ``(T, Hkv, Dv)`` (None for a
        KV-sharing layer, or a cross layer whose encoder K/V are already cached); all in the
        layer's ``dtype`` and on its device. Where ``supports_quant_query_input``, the query may
        instead be float8_e4m3fn holding ``q / q_scale`` (the output stays in ``dtype``). kv_cache: from ``allocate_kv_cache`` (None for
        encoder / encoder_only layers). attn_metadata: ``metadata_builder().build(common)``.
        output: optional ``(T, Hq, Dv)`` buffer written in place (the same object is returned);
        None allocates one beside ``query`` (NumPy for NumPy, torch on the same device for torch).
        return_lse: also return the log-sum-exp ``(Hq, T)`` float32, natural log (-inf for a row
        that saw no key), mergeable with ``merge_attn_states``.
        output_scale: float32 ``(1,)`` tensor: write an fp8_e4m3 output ``saturate(o / scale)``
        (only backends with the "fp8_output" feature).

        Only the first ``attn_metadata.num_actual_tokens`` rows are defined (the rest are
        padding, e.g. for CUDA graphs). Returns ``output`` or ``(output, lse)``.
        """
        if attn_metadata is None:
            raise _tensors.error("attn_metadata", "attn_metadata is None: expected the result of "
                                 "metadata_builder().build(common)")
        t = _tensors.num_tokens(query)
        if output is None:
            dtype = "float8_e4m3fn" if output_scale is not None else self.dtype
            output = _tensors.empty_like(query, (t, self.num_heads, self.head_size_v), dtype)
        lse = None
        if return_lse:
            lse = _tensors.empty_like(query, (self.num_heads, t), "float32")
        _tensors.use_stream_of(query)
        self._forward(query, key, value, kv_cache, attn_metadata, output, lse, output_scale)
        return (output, lse) if return_lse else output

    def __repr__(self) -> str:
        return (f"pagedattn.Attention(num_heads={self.num_heads}, head_size={self.head_size}, "
                f"num_kv_heads={self.num_kv_heads}, dtype={self.dtype!r}, device={self.device!r}, "
                f"backend={self.backend.name!r}, prefix={self.layer_name!r})")
