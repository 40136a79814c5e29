"""The array frameworks a test runs with: NumPy, PyTorch on the CPU, PyTorch on CUDA.

PyTorch variants skip when torch is not installed; the CUDA one also when there is no CUDA
device or pagedattn was built without CUDA. PyTorch is not a CI dependency: on a GPU machine
(scripts/gpu-check) the same tests run with device="cuda".
"""

from __future__ import annotations

import numpy as np
import pytest

import pagedattn
from pagedattn._tensors import numpy_dtype


def torch_or_skip():
    return pytest.importorskip("torch", reason="PyTorch is not installed")


def cuda_or_skip():
    torch = torch_or_skip()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to PyTorch")
    if not pagedattn.built_with_cuda():
        pytest.skip("pagedattn was built without CUDA")
    if pagedattn.cuda_device_count() == 0:
        pytest.skip("pagedattn sees no CUDA device")
    return torch


class NumpyFramework:
    name = "numpy"
    device = "cpu"

    def array(self, a, dtype: str):
        return np.asarray(a, dtype=np.float32).astype(numpy_dtype(dtype))

    def ints(self, a, dtype=np.int64):
        return np.asarray(a, dtype=dtype)

    def host(self, x) -> np.ndarray:
        with np.errstate(invalid="ignore"):  # NaN poison in ml_dtypes arrays
            return np.asarray(x).astype(np.float64)

    def fill(self, x, value: float) -> None:
        x[...] = value

    def assign(self, x, host_values: np.ndarray) -> None:
        x[...] = host_values.astype(x.dtype)

    def empty(self, shape, dtype: str):
        return np.empty(shape, dtype=numpy_dtype(dtype))

    def data_ptr(self, x) -> int:
        return x.__array_interface__["data"][0]

    def is_tensor(self, x) -> bool:
        return isinstance(x, np.ndarray)

    def cache_framework(self) -> str:
        return "numpy"


class TorchFramework:
    def __init__(self, device: str):
        self.torch = cuda_or_skip() if device == "cuda" else torch_or_skip()
        self.device = device
        self.name = f"torch-{device}"

    def array(self, a, dtype: str):
        t = self.torch.from_numpy(np.ascontiguousarray(np.asarray(a, dtype=np.float32)))
        return t.to(device=self.device, dtype=getattr(self.torch, dtype))

    def ints(self, a, dtype=np.int64):
        return self.torch.from_numpy(np.asarray(a, dtype=dtype)).to(self.device)

    def host(self, x) -> np.ndarray:
        with np.errstate(invalid="ignore"):  # NaN poison
            return x.detach().float().cpu().numpy().astype(np.float64)

    def fill(self, x, value: float) -> None:
        x.fill_(value)

    def assign(self, x, host_values: np.ndarray) -> None:
        x.copy_(self.torch.from_numpy(np.ascontiguousarray(host_values, dtype=np.float32)))

    def empty(self, shape, dtype: str):
        return self.torch.empty(shape, dtype=getattr(self.torch, dtype), device=self.device)

    def data_ptr(self, x) -> int:
        return x.data_ptr()

    def is_tensor(self, x) -> bool:
        return isinstance(x, self.torch.Tensor) and x.device.type == self.device

    def cache_framework(self) -> str:
        return "torch"


def attention_or_skip(device: str, *args, **kwargs):
    """pagedattn.Attention(*args, device=device, **kwargs); on CUDA a skip (with the selector's
    reasons) when no registered backend runs the configuration there."""
    try:
        return pagedattn.Attention(*args, device=device, **kwargs)
    except pagedattn.Error as exc:
        if device == "cuda":
            pytest.skip(f"no backend runs this configuration on CUDA: {exc}")
        raise


FRAMEWORKS = ["numpy", "torch-cpu", "torch-cuda"]


def make_framework(name: str):
    if name == "numpy":
        return NumpyFramework()
    return TorchFramework(name.split("-", 1)[1])
