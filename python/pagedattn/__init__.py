"""pagedattn: the attention subsystem of an LLM serving engine, from Python.

Paged KV cache, backends behind one interface with a selector that says why each one fits or
not, metadata builders, and kernels -- with vLLM's names and semantics. Tensors go in and out
through DLPack without copies: NumPy arrays (float32, float16, and bfloat16 / float8 through
ml_dtypes), PyTorch CPU and CUDA tensors, or any object with ``__dlpack__``.

Main entry points:
    Attention(num_heads, head_size, scale, ...)        a layer: .forward(...), .allocate_kv_cache()
    MLAAttention(num_heads, scale, ..., kv_b_proj)     an MLA (DeepSeek latent attention) layer
    CommonAttentionMetadata(query_start_loc, ...)      one step's batch
    Attention.metadata_builder().build(common)         a backend's plan for the step
      .build_for_drafting(common, draft_index)         a cheap plan for a draft step
    StaticForwardContext(), ForwardContext(...)        layers by name; a step's plans and caches
    get_per_layer_parameters, infer_global_hyperparameters   per-layer plan hyperparameters
    get_attn_backend(...), list_backends()             the selector and the registry
    reshape_and_cache_flash(...), merge_attn_states()  standalone ops
    concat_and_cache_mla(...), gather_and_maybe_dequant_cache(...)   MLA cache ops
    get_mla_prefill_backend(...), list_mla_prefill_backends()        MLA prefill selector
    split_decodes_and_prefills, reorder_batch_to_split_decodes_and_prefills,
    make_local_attention_virtual_batches, use_cascade_attention   batch utilities
    Attention(..., dcp_world_size=N, dcp_rank=r), dcp_forward(...)   decode context parallelism:
      DcpConfig, get_dcp_local_seq_lens, dcp_plan / dcp_attend / dcp_combine, DcpCommunicator,
      make_in_memory_dcp_group, run_dcp_ranks, TorchDcpCommunicator, NcclDcpCommunicator

Invalid arguments raise ``pagedattn.Error``, a ``ValueError`` whose message names the argument.
"""

from __future__ import annotations

from . import _C  # noqa: F401  (the extension, as pagedattn._C)
from ._C import (
    AttentionBackend,
    AttentionMetadata,
    AttentionMetadataBuilder,
    Error,
    KVCacheSpec,
    MLAAttentionMetadata,
    MLADimensions,
    MLAPrefillBackend,
    MultipleOf,
    PerLayerParameters,
    RegisteredLayer,
    StaticForwardContext,
    built_with_cuda,
    canonical_dtype,
    common_prefix_len,
    cuda_device_count,
    current_cuda_stream,
    device_capability,
    explain_mla_prefill_backends,
    find_backend,
    find_mla_prefill_backend,
    get_attn_backend,
    get_kv_cache_layout,
    get_mla_prefill_backend,
    get_per_layer_parameters,
    infer_global_hyperparameters,
    is_quantized_kv_cache,
    kv_cache_storage_dtype,
    list_backends,
    list_mla_prefill_backends,
    mla_attention_spec,
    mla_chunked_prefill_workspace_tokens,
    reorder_batch_to_split_decodes_and_prefills,
    set_current_cuda_stream,
    set_kv_cache_layout,
    split_decodes_and_prefills,
    synchronize_cuda,
    use_cascade_attention,
    validate_kv_cache_dtype,
)
from ._C import (
    DcpCommunicator,
    DcpConfig,
    DcpPlan,
    built_with_nccl,
    current_cuda_device,
    dcp_local_position,
    dcp_owner,
    make_in_memory_dcp_group,
    set_current_cuda_device,
)
from ._dcp import (TorchDcpCommunicator, dcp_attend, dcp_combine, dcp_forward, dcp_plan,
                   get_dcp_local_seq_lens, run_dcp_ranks)
from ._forward_context import ForwardContext
from ._layer import Attention
from ._metadata import CommonAttentionMetadata, make_local_attention_virtual_batches
from ._mla import MLAAttention
from ._ops import (concat_and_cache_mla, gather_and_maybe_dequant_cache, merge_attn_states,
                   reshape_and_cache, reshape_and_cache_flash)

__version__ = "0.1.0"


class AttentionType:
    """Attention type (vLLM's ``AttentionType``: strings, so they compare equal to "decoder"...)."""

    DECODER = "decoder"
    """Decoder attention between previous layer Q/K/V: causal over the paged cache."""
    ENCODER = "encoder"
    """Encoder attention between previous layer Q/K/V for encoder-decoder: non-causal, no cache."""
    ENCODER_ONLY = "encoder_only"
    """Encoder attention between previous layer Q/K/V: non-causal, no cache (BERT-like)."""
    ENCODER_DECODER = "encoder_decoder"
    """Attention between decoder Q and encoder K/V for encoder-decoder (cross-attention)."""


__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionMetadata",
    "AttentionMetadataBuilder",
    "AttentionType",
    "CommonAttentionMetadata",
    "Error",
    "ForwardContext",
    "KVCacheSpec",
    "MLAAttention",
    "MLAAttentionMetadata",
    "MLADimensions",
    "MLAPrefillBackend",
    "MultipleOf",
    "PerLayerParameters",
    "RegisteredLayer",
    "StaticForwardContext",
    "built_with_cuda",
    "canonical_dtype",
    "common_prefix_len",
    "concat_and_cache_mla",
    "cuda_device_count",
    "current_cuda_stream",
    "device_capability",
    "explain_mla_prefill_backends",
    "find_backend",
    "find_mla_prefill_backend",
    "gather_and_maybe_dequant_cache",
    "get_attn_backend",
    "get_kv_cache_layout",
    "get_mla_prefill_backend",
    "get_per_layer_parameters",
    "infer_global_hyperparameters",
    "is_quantized_kv_cache",
    "kv_cache_storage_dtype",
    "list_backends",
    "list_mla_prefill_backends",
    "make_local_attention_virtual_batches",
    "merge_attn_states",
    "mla_attention_spec",
    "mla_chunked_prefill_workspace_tokens",
    "reorder_batch_to_split_decodes_and_prefills",
    "reshape_and_cache",
    "reshape_and_cache_flash",
    "set_current_cuda_stream",
    "set_kv_cache_layout",
    "split_decodes_and_prefills",
    "synchronize_cuda",
    "use_cascade_attention",
    "validate_kv_cache_dtype",
    # decode context parallelism
    "DcpCommunicator",
    "DcpConfig",
    "DcpPlan",
    "TorchDcpCommunicator",
    "built_with_nccl",
    "current_cuda_device",
    "dcp_attend",
    "dcp_combine",
    "dcp_forward",
    "dcp_local_position",
    "dcp_owner",
    "dcp_plan",
    "get_dcp_local_seq_lens",
    "make_in_memory_dcp_group",
    "run_dcp_ranks",
    "set_current_cuda_device",
]

if _C.built_with_nccl():  # the NCCL communicator (CUDA builds that found NCCL)
    from ._C import NcclDcpCommunicator, nccl_unique_id, nccl_version, wrap_nccl_dcp_communicator

    __all__ += ["NcclDcpCommunicator", "nccl_unique_id", "nccl_version",
                "wrap_nccl_dcp_communicator"]
