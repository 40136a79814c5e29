"""Framework helpers: dtypes, allocation of outputs beside an input, host integer arrays.

Tensors are never copied on their way into the library (the extension imports them through
DLPack); the only allocations made here are the outputs a caller did not pass, made in the
caller's framework (NumPy array for NumPy input, torch.Tensor on the same device for PyTorch
input) so that they share memory with nothing else and export DLPack themselves.
"""

from __future__ import annotations

import numbers
import sys
from typing import Any, Sequence

import numpy as np

from . import _C

# dtypes NumPy knows only through ml_dtypes
_ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2")


def error(argument: str, message: str) -> Exception:
    """A pagedattn.Error (a ValueError) naming `argument`."""
    exc = _C.Error(message)
    exc.argument = argument
    return exc


def _torch():
    return sys.modules.get("torch")


def is_torch_tensor(x: Any) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def numpy_dtype(name: str) -> np.dtype:
    """NumPy dtype for a framework dtype name ("bfloat16" through ml_dtypes)."""
    if name in _ML_DTYPES:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _dlpack_device(x: Any) -> tuple[int, int]:
    if hasattr(x, "__dlpack_device__"):
        dev = x.__dlpack_device__()
        return int(dev[0]), int(dev[1])
    return 1, 0  # host


def empty_like(ref: Any, shape: Sequence[int], dtype: str, argument: str = "query") -> Any:
    """An uninitialised tensor of `shape` and framework dtype name `dtype`, in the framework and
    on the device of `ref`."""
    shape = tuple(int(s) for s in shape)
    if is_torch_tensor(ref):
        import torch

        return torch.empty(shape, dtype=torch_dtype(dtype), device=ref.device)
    if isinstance(ref, np.ndarray):
        return np.empty(shape, dtype=numpy_dtype(dtype))
    device_type, device_id = _dlpack_device(ref)
    if device_type in (1, 3):  # kDLCPU, kDLCUDAHost
        return np.empty(shape, dtype=numpy_dtype(dtype))
    if device_type in (2, 13):  # kDLCUDA, kDLCUDAManaged
        try:
            import torch
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise error(argument, f"{argument} is a CUDA tensor of type {type(ref).__name__}: "
                        "pass `output=` too, or install PyTorch to let pagedattn allocate it") from exc
        return torch.empty(shape, dtype=torch_dtype(dtype), device=f"cuda:{device_id}")
    raise error(argument, f"{argument} is on DLPack device type {device_type}: expected a CPU or "
                "CUDA tensor")


def num_tokens(query: Any, argument: str = "query") -> int:
    shape = getattr(query, "shape", None)
    if shape is None or len(shape) == 0:
        raise error(argument, f"{argument} is a {type(query).__name__}: expected a tensor of shape "
                    "(num_tokens, num_heads, head_size)")
    return int(shape[0])


def as_dtype(array: Any, name: str) -> Any:
    """Re-views an array exported by the extension (bf16 / fp8 come out as unsigned ints of the
    same width) as dtype `name`. No copy."""
    if is_torch_tensor(array):
        want = torch_dtype(name)
        return array if array.dtype == want else array.view(want)
    want = numpy_dtype(name)
    return array if array.dtype == want else array.view(want)


def to_torch(array: np.ndarray, name: str):
    """A torch.Tensor sharing memory with NumPy `array`, viewed as dtype `name`."""
    import torch

    width = np.dtype(array.dtype).itemsize
    if name in _ML_DTYPES or array.dtype.kind == "u" and width > 1:
        # torch.from_numpy lacks some unsigned types: go through signed ints of the same width.
        array = array.view({1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[width])
    return as_dtype(torch.from_numpy(array), name)


def cache_in_framework(array: Any, dtype: str, device: str, framework: Any) -> Any:
    """A freshly allocated cache ``array`` (storage dtype ``dtype``) handed out as the caller asked:
    framework "numpy" or "torch"; None = NumPy for device "cpu", torch for "cuda"."""
    if framework is None:
        framework = "torch" if device == "cuda" else "numpy"
    if framework == "torch":
        if device == "cuda":
            return as_dtype(array, dtype)
        return to_torch(array, dtype)
    if framework != "numpy":
        raise error("framework", f'framework = "{framework}": expected "numpy" or "torch"')
    if device == "cuda":
        raise error("framework", 'framework = "numpy" cannot hold a CUDA cache: use "torch"')
    return as_dtype(array, dtype)


def use_stream_of(tensor: Any) -> None:
    """Makes pagedattn launch on PyTorch's current stream of `tensor`'s device (CUDA tensors)."""
    if is_torch_tensor(tensor) and tensor.is_cuda:
        import torch

        _C.set_current_cuda_stream(torch.cuda.current_stream(tensor.device).cuda_stream)


_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def int32_arg(value: Any, argument: str) -> int:
    """`value` as an int for one of the library's 32-bit integer parameters (head counts, sizes,
    token counts). Raises pagedattn.Error naming `argument` when it is not an integer or does not
    fit (the binding would otherwise raise a TypeError that names nothing)."""
    try:
        v = int(value)
    except (TypeError, ValueError) as exc:
        raise error(argument, f"{argument} = {value!r} is not an integer") from exc
    if not _INT32_MIN <= v <= _INT32_MAX:
        raise error(argument, f"{argument} = {v} is out of range: expected an integer in "
                    f"[{_INT32_MIN}, {_INT32_MAX}] (32-bit)")
    return v


def host_ints(x: Any, dtype: Any, argument: str, ndim: int) -> np.ndarray:
    """`x` (list, NumPy array, torch tensor on any device, DLPack object) as a C-contiguous host
    array of integer `dtype` with `ndim` dimensions. Raises pagedattn.Error naming `argument`."""
    if x is None:
        raise error(argument, f"{argument} is None: expected an array of integers")
    if is_torch_tensor(x):
        x = x.detach().cpu().numpy()
    elif not isinstance(x, np.ndarray) and hasattr(x, "__dlpack__"):
        try:
            x = np.from_dlpack(x)
        except (BufferError, RuntimeError, TypeError) as exc:
            raise error(argument, f"{argument} could not be read on the host: {exc}") from exc
    try:
        a = np.asarray(x)
    except (TypeError, ValueError) as exc:
        raise error(argument, f"{argument} is not an array of integers: {exc}") from exc
    if a.dtype.kind not in "iu":
        if a.size == 0:
            a = a.astype(dtype)
        else:
            raise error(argument, f"{argument} has dtype {a.dtype}: expected integers")
    if a.ndim != ndim:
        raise error(argument, f"{argument} has {a.ndim} dimension(s) (shape {a.shape}): "
                    f"expected {ndim}")
    info = np.iinfo(dtype)
    if a.size and (int(a.min()) < info.min or int(a.max()) > info.max):
        raise error(argument, f"{argument} has values in [{int(a.min())}, {int(a.max())}], "
                    f"outside the range of {np.dtype(dtype).name}")
    return np.ascontiguousarray(a, dtype=dtype)


def float_list(x: Any, argument: str) -> list[float] | None:
    """None, a sequence or a tensor of floats as a list (for per-head layer parameters)."""
    if x is None:
        return None
    if is_torch_tensor(x):
        x = x.detach().float().cpu().numpy()
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 1:
        raise error(argument, f"{argument} has shape {a.shape}: expected one value per query head")
    return [float(v) for v in a]


def scale_arg(x: Any, argument: str) -> tuple[float, Any]:
    """A k/v scale: a number or a 1-element tensor -> (value, None); a (num_kv_heads,) float32
    tensor -> (1.0, tensor), the per-head scales."""
    if isinstance(x, numbers.Real):
        return float(x), None
    if isinstance(x, (list, tuple)):
        x = np.asarray(x, dtype=np.float32)
    if is_torch_tensor(x):
        n = x.numel()
    elif hasattr(x, "shape"):
        n = int(np.prod(x.shape))
    else:
        raise error(argument, f"{argument} is a {type(x).__name__}: expected a float or a "
                    "float32 tensor of shape (1,) or (num_kv_heads,)")
    if n == 1:
        return float(x.reshape(-1)[0]), None
    return 1.0, x
