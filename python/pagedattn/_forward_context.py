"""pagedattn.ForwardContext: one step's metadata and caches by layer name (vLLM's forward context)."""

from __future__ import annotations

from typing import Any, Mapping, Optional

from . import _C


class ForwardContext:
    """What the layers of one step read, by layer name (vLLM's ``ForwardContext``, whose
    ``attn_metadata`` maps layer names to their group's plan; the caches, which vLLM keeps on the
    layers, are here too). The lookups are the C++ ``ForwardContext``'s, with its errors.

    Arguments:
        attn_metadata: layer name -> ``AttentionMetadata`` (the plan of the layer's KV-cache
            group: every layer of a group maps to the same plan).
        kv_caches: layer name -> the cache that layer owns (``allocate_kv_cache``). A layer with
            ``kv_sharing_target_layer_name`` reads its target's entry; it needs none of its own.

    Both are plain dicts (``.attn_metadata``, ``.kv_caches``), replaced or updated every step.

    Typical use::

        ctx = pagedattn.ForwardContext({l.layer_name: plan for l in layers},
                                       {l.layer_name: cache for l, cache in owned})
        out = ctx.forward(layer, q, k, v)
    """

    def __init__(self, attn_metadata: Optional[Mapping[str, Any]] = None,
                 kv_caches: Optional[Mapping[str, Any]] = None) -> None:
        self.attn_metadata: dict[str, Any] = dict(attn_metadata or {})
        self.kv_caches: dict[str, Any] = dict(kv_caches or {})

    def metadata_for(self, layer: _C._Attention) -> _C.AttentionMetadata:
        """The plan stored under ``layer``'s name; pagedattn.Error naming ``attn_metadata`` when
        there is none."""
        return _C._forward_context_metadata_for(self.attn_metadata, layer)

    def kv_cache_for(self, layer: _C._Attention) -> Any:
        """The cache ``layer`` reads: its own, or its ``kv_sharing_target_layer_name``'s;
        pagedattn.Error naming ``kv_caches`` (and both layers when sharing) when missing."""
        return _C._forward_context_kv_cache_for(self.kv_caches, layer)

    def forward(self, layer: Any, query: Any, key: Any, value: Any, output: Any = None,
                return_lse: bool = False) -> Any:
        """``layer.forward`` with this step's plan and cache for it (encoder / encoder_only
        layers have no cache: an entry under their name is ignored). Returns what
        ``Attention.forward`` returns."""
        metadata = self.metadata_for(layer)
        has_cache = layer.attn_type not in ("encoder", "encoder_only")
        kv_cache = self.kv_cache_for(layer) if has_cache else None
        return layer.forward(query, key, value, kv_cache, metadata, output, return_lse)

    def __repr__(self) -> str:
        return (f"pagedattn.ForwardContext(attn_metadata={sorted(self.attn_metadata)!r}, "
                f"kv_caches={sorted(self.kv_caches)!r})")
