"""Decode context parallelism (DCP; vLLM's dcp_world_size / dcp_rank / cp_kv_cache_interleave_size).

A request's KV cache is striped over a group of N ranks, so a context N times longer fits and N
devices read it at once. Global token ``t`` lives on rank ``(t // I) % N`` (``I`` = interleave) at
position ``(t // (I N)) I + t % I`` of that rank's own sequence. The block table is the same on
every rank: entry ``b`` is a "virtual block" of ``B N`` tokens (``B`` = the cache's block size)
naming, in every rank's own cache, the physical block that holds that rank's ``B`` tokens of it.

One step of one layer on one rank (``dcp_forward``, or ``dcp_plan`` + ``dcp_attend`` +
``dcp_combine``): the step's new keys / values are written on their owners, each rank attends its
keys, and an all-gather of (output, LSE) over the group merges them, so every rank ends with the
full attention of every row, with the same bits on every rank.

The group's communication is a ``DcpCommunicator``: ``make_in_memory_dcp_group(n)`` (N ranks as
threads of one process, host tensors), ``NcclDcpCommunicator`` (one GPU per rank, when
``built_with_nccl()``), ``TorchDcpCommunicator`` (a ``torch.distributed`` process group), or a
Python subclass of ``DcpCommunicator``.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from . import _C
from . import _tensors

DcpConfig = _C.DcpConfig
DcpCommunicator = _C.DcpCommunicator
DcpPlan = _C.DcpPlan


def get_dcp_local_seq_lens(
    seq_lens: Any,
    dcp_size: int = 1,
    dcp_rank: Optional[int] = None,
    cp_kv_cache_interleave_size: int = 1,
) -> Any:
    """Tokens of each request's ``[0, seq_len)`` that a DCP rank holds (vLLM's
    ``get_dcp_local_seq_lens``, same arguments).

    seq_lens: ``(num_reqs,)`` integers (list, NumPy array or tensor). dcp_rank: one rank's
    lengths ``(num_reqs,)``; None = every rank's, ``(num_reqs, dcp_size)``. Returns int32: a NumPy
    array, or a torch tensor on the device of a torch ``seq_lens``.
    """
    i32 = _tensors.int32_arg
    lens = _tensors.host_ints(seq_lens, np.int32, "seq_lens", 1)
    size = i32(dcp_size, "dcp_size")
    interleave = i32(cp_kv_cache_interleave_size, "cp_kv_cache_interleave_size")
    values = lens.tolist()
    if dcp_rank is None:
        _C._get_dcp_local_seq_lens(values, size, 0, interleave)  # checks the arguments
        out = np.stack([_C._get_dcp_local_seq_lens(values, size, r, interleave) for r in range(size)],
                       axis=1).reshape(len(values), size)
    else:
        out = _C._get_dcp_local_seq_lens(values, size, i32(dcp_rank, "dcp_rank"), interleave)
    if _tensors.is_torch_tensor(seq_lens):
        import torch

        return torch.from_numpy(out).to(seq_lens.device)
    return out


def run_dcp_ranks(world_size: int, body: Callable[[int], Any],
                  timeout: Optional[float] = None, group: Optional[list] = None) -> list[Any]:
    """Runs ``body(rank)`` for rank 0 .. world_size - 1, one thread each, and returns their
    results in rank order; re-raises the exception of the rank that failed first (as the C++
    run_dcp_ranks).

    The ranks of an in-memory group (``make_in_memory_dcp_group``) block in their all-gather until
    every rank has arrived. group: the ranks' communicators: when a rank raises, each is aborted
    (``DcpCommunicator.abort``), so the others leave their collectives with an error instead of
    waiting for it. timeout (seconds): raise TimeoutError (chained to the first rank's exception,
    if any) instead of waiting for ever; the waiting threads are daemons.
    """
    n = _tensors.int32_arg(world_size, "world_size")
    if n < 1:
        raise _tensors.error("world_size", f"world_size = {n}: expected >= 1")
    results: list[Any] = [None] * n
    errors: list[Optional[BaseException]] = [None] * n
    failed: list[int] = []  # ranks in the order they failed
    lock = threading.Lock()

    def run(rank: int) -> None:
        try:
            results[rank] = body(rank)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors[rank] = exc
            with lock:
                failed.append(rank)
                first = len(failed) == 1
            if first and group is not None:
                for comm in group:
                    comm.abort()

    threads = [threading.Thread(target=run, args=(r,), name=f"dcp-rank-{r}", daemon=True)
               for r in range(n)]
    for t in threads:
        t.start()
    deadline = None if timeout is None else time.monotonic() + float(timeout)
    for rank, t in enumerate(threads):
        t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            first_error = errors[failed[0]] if failed else None
            raise TimeoutError(f"DCP rank {rank} of {n} did not finish within {timeout} s (a rank "
                               "that fails before a collective leaves the others waiting in "
                               "it unless run_dcp_ranks is given the group)") from first_error
    if failed:
        raise errors[failed[0]]
    return results


# ---- arguments -------------------------------------------------------------------------------------

def _layer_dims(layer: Any) -> tuple[int, int]:
    """(num_heads, value head size) of a standard or MLA layer; Error naming `layer` otherwise."""
    if isinstance(layer, _C._MLAAttention):
        return layer.num_heads, layer.v_head_dim
    if isinstance(layer, _C._Attention):
        return layer.num_heads, layer.head_size_v
    raise _tensors.error("layer", f"layer is a {type(layer).__name__}: expected a "
                         "pagedattn.Attention or pagedattn.MLAAttention")


def _config_arg(config: Any) -> Optional[_C.DcpConfig]:
    if config is None or isinstance(config, _C.DcpConfig):
        return config
    raise _tensors.error("config", f"config is a {type(config).__name__}: expected a "
                         "pagedattn.DcpConfig, or None for the layer's own group")


def _common_arg(common: Any) -> _C.CommonAttentionMetadata:
    if isinstance(common, _C.CommonAttentionMetadata):
        return common
    raise _tensors.error("common", f"common is a {type(common).__name__}: expected the global "
                         "step as a pagedattn.CommonAttentionMetadata (block_table of virtual "
                         "blocks; slot_mapping is not read)")


def _outputs(ref: Any, t: int, heads: int, head_size_v: int, dtype: str, out: Any, lse: Any,
             return_lse: bool, argument: str) -> tuple[Any, Any]:
    if out is None:
        out = _tensors.empty_like(ref, (t, heads, head_size_v), dtype, argument)
    if lse is None and return_lse:
        lse = _tensors.empty_like(ref, (heads, t), "float32", argument)
    return out, lse


# ---- the step --------------------------------------------------------------------------------------

def dcp_plan(layer: Any, builder: _C.AttentionMetadataBuilder, config: Optional[_C.DcpConfig],
             common: _C.CommonAttentionMetadata) -> _C.DcpPlan:
    """Plans this rank's share of one global step for ``layer`` (C++ ``dcp_plan``).

    layer: a ``pagedattn.Attention`` (not with ALiBi, a sliding window, chunked local attention,
    sinks or KV sharing) or ``pagedattn.MLAAttention`` created with this rank's group.
    builder: this rank's ``layer.metadata_builder(...)`` (its max_num_seqs must hold the local
    requests: a prefill row held elsewhere is a local request of its own). config: the group
    (``DcpConfig``), which must be the layer's; None = the layer's. common: the global step as a
    ``CommonAttentionMetadata``: query_start_loc, seq_lens, block_table of virtual blocks (``B N``
    tokens each), causal; its slot_mapping is not read (pass the virtual slots or -1: each rank's
    slots are derived).

    Builds the local step (reordered as the builder asks), has the builder plan it and allocates
    every buffer of the step on the layer's device, so that ``dcp_attend`` / ``dcp_combine``
    issue only kernels and the collective (CUDA-graph capturable). The builder's next ``build()``
    invalidates the plan (the plan keeps the builder alive).
    """
    _layer_dims(layer)
    return _C._dcp_plan(layer, builder, _config_arg(config), _common_arg(common))


def dcp_attend(layer: Any, plan: _C.DcpPlan, query: Any, key: Any, value: Any,
               kv_cache: Any) -> None:
    """This rank's local attention of a planned step (C++ ``dcp_attend``): writes the step's new
    keys / values where this rank holds them, attends over its keys and packs the result for
    ``dcp_combine``.

    query, key, value: the global step's rows ``(T, ...)`` on the plan's device, as the layer's
    ``forward`` takes them: ``(T, Hq, D)``, ``(T, Hkv, D)``, ``(T, Hkv, Dv)`` for an
    ``Attention``; q ``(T, H, P + R)``, kv_c_normed ``(T, L)``, k_pe ``(T, R)`` for an
    ``MLAAttention`` (errors then name q / kv_c_normed / k_pe). kv_cache: this rank's cache.
    """
    _layer_dims(layer)
    if not isinstance(plan, _C.DcpPlan):
        raise _tensors.error("plan", f"plan is a {type(plan).__name__}: expected the DcpPlan of "
                             "dcp_plan(layer, ...)")
    _tensors.use_stream_of(query)
    _C._dcp_attend(layer, plan, query, key, value, kv_cache)


def dcp_combine(plan: _C.DcpPlan, comm: _C.DcpCommunicator, out: Any = None, lse: Any = None, *,
                return_lse: bool = False) -> Any:
    """The group's combine of a planned, attended step (C++ ``dcp_combine``): all-gathers every
    rank's (output, LSE) over ``comm`` and merges them by LSE, so that every rank holds the full
    attention of every row (the same bits on every rank). Blocks until every rank has called it
    (the GIL is released meanwhile).

    comm: this rank's communicator (its world_size / rank those of the plan, its device the
    plan's). out: ``(>= T, H, Dv)`` in the layer's dtype, written in place; None allocates it (NumPy
    on the host, torch on CUDA). lse: float32 ``(H, >= T)`` for the merged log-sum-exp; None with
    return_lse=True allocates it. Returns ``out``, or ``(out, lse)`` when an lse is given or asked
    for.
    """
    if not isinstance(plan, _C.DcpPlan):
        raise _tensors.error("plan", f"plan is a {type(plan).__name__}: expected the DcpPlan of "
                             "dcp_plan(layer, ...)")
    shape = (plan.num_tokens, plan.num_heads, plan.head_size_v)
    if out is None or (lse is None and return_lse):
        if plan.device == "cuda":
            import torch

            dev = f"cuda:{_C.current_cuda_device()}"
            if out is None:
                out = torch.empty(shape, dtype=_tensors.torch_dtype(plan.dtype), device=dev)
            if lse is None and return_lse:
                lse = torch.empty((shape[1], shape[0]), dtype=torch.float32, device=dev)
        else:
            if out is None:
                out = np.empty(shape, dtype=_tensors.numpy_dtype(plan.dtype))
            if lse is None and return_lse:
                lse = np.empty((shape[1], shape[0]), dtype=np.float32)
    _tensors.use_stream_of(out)
    _C._dcp_combine(plan, comm, out, lse)
    return (out, lse) if lse is not None else out


def dcp_forward(layer: Any, builder: _C.AttentionMetadataBuilder, comm: _C.DcpCommunicator,
                config: Optional[_C.DcpConfig], common: _C.CommonAttentionMetadata, query: Any,
                key: Any, value: Any, kv_cache: Any, out: Any = None, lse: Any = None, *,
                return_lse: bool = False) -> Any:
    """One rank's DCP step of one layer in one call: ``dcp_plan``, ``dcp_attend``, ``dcp_combine``
    (C++ ``dcp_forward``). Every rank of the group calls it with the same global step and inputs.

    layer, builder, config, common: as ``dcp_plan``; comm: this rank's ``DcpCommunicator`` (its
    world_size / rank must be config's). query, key, value, kv_cache: as ``dcp_attend`` (the
    standard layer's query / key / value, or an MLA layer's q / kv_c_normed / k_pe). out: ``(T,
    H, Dv)`` output written in place, None allocates it beside ``query``. lse: float32 ``(H, T)``
    merged log-sum-exp, None with return_lse=True allocates it. Returns ``out`` or ``(out, lse)``.

    Host tensors run with the in-memory group or a host communicator (e.g. TorchDcpCommunicator
    over gloo); CUDA tensors with NcclDcpCommunicator or TorchDcpCommunicator over NCCL. The GIL is
    released while the step runs (it blocks in the all-gather until every rank arrives).
    """
    heads, head_size_v = _layer_dims(layer)
    t = _tensors.num_tokens(query)
    out, lse = _outputs(query, t, heads, head_size_v, layer.dtype, out, lse, return_lse, "query")
    _tensors.use_stream_of(query)
    _C._dcp_forward(layer, builder, comm, _config_arg(config), _common_arg(common), query, key,
                    value, kv_cache, out, lse)
    return (out, lse) if lse is not None else out


# ---- torch.distributed ------------------------------------------------------------------------------

def _torch_bytes(x: Any):
    """A flat uint8 torch view of a buffer handed to all_gather (NumPy array or torch tensor)."""
    import torch

    if isinstance(x, torch.Tensor):
        return x.reshape(-1).view(torch.uint8)
    return torch.from_numpy(np.asarray(x).reshape(-1).view(np.uint8))


class TorchDcpCommunicator(_C.DcpCommunicator):
    """A DCP group over a ``torch.distributed`` process group (an engine's DCP group): all_gather
    is ``torch.distributed.all_gather_into_tensor`` on ``group``, so gloo runs host steps and NCCL
    runs CUDA steps (on the current torch stream, which pagedattn's functions launch on too).

    group: the process group (None = the default group); world_size / rank are the group's.
    device: "cpu" or "cuda", where the step's tensors live; None = "cuda" for an NCCL group, else
    "cpu". torch.distributed must be initialized. PyTorch is imported here, not by pagedattn.
    """

    def __init__(self, group: Any = None, device: Optional[str] = None) -> None:
        super().__init__()
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise _tensors.error("group", "torch.distributed is not initialized: call "
                                 "torch.distributed.init_process_group first")
        self._group = group
        self._world_size = int(dist.get_world_size(group))
        self._rank = int(dist.get_rank(group))
        if device is None:
            backend = str(dist.get_backend(group)).lower()
            device = "cuda" if "nccl" in backend and "gloo" not in backend else "cpu"
        device = str(device).split(":")[0]
        if device not in ("cpu", "cuda"):
            raise _tensors.error("device", f'device = "{device}": expected "cpu" or "cuda"')
        self._device = device
        self._into_tensor = True  # False once a backend refused all_gather_into_tensor

    @property
    def group(self) -> Any:
        """The torch.distributed process group (None = the default group)."""
        return self._group

    def world_size(self) -> int:
        return self._world_size

    def rank(self) -> int:
        return self._rank

    def device(self) -> str:
        return self._device

    def all_gather(self, send: Any, recv: Any) -> None:
        import torch.distributed as dist

        # Flat bytes: recv as the concatenation of the ranks' sends (gloo splits the output into
        # world_size chunks of the input's shape).
        s = _torch_bytes(send)
        r = _torch_bytes(recv)
        if self._into_tensor:
            try:
                dist.all_gather_into_tensor(r, s, group=self._group)
                return
            except (RuntimeError, NotImplementedError) as exc:
                # Older gloo builds have no allgather_into_tensor: the same collective as a list.
                if self._device != "cpu" or "support" not in str(exc):
                    raise
                self._into_tensor = False
        dist.all_gather(list(r.view(self._world_size, -1).unbind(0)), s, group=self._group)

    def __repr__(self) -> str:
        return (f"<pagedattn.TorchDcpCommunicator rank {self._rank} of {self._world_size} on "
                f"{self._device}>")
