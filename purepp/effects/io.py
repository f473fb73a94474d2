"""The rank step's tensor seam (`purepp.rank.StepIO`) over the numpy and torch interpreters."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from purepp._checks import check_instance
from purepp._text import a_type, with_article
from purepp._trusted import trusted
from purepp.effects.arrays import IntArray
from purepp.effects.numpy_interpreter import NumpyInterpreter
from purepp.effects.vocabulary import BufferRef, DType, TensorSpec
from purepp.errors import InterpreterError, InvalidInputError

if TYPE_CHECKING:
    import torch

    from purepp.effects.torch_interpreter import TorchInterpreter

__all__ = ["NumpyIO", "TorchIO", "numpy_spec"]

# A spec is asked for every caller tensor a step reads: built from the tensor's own shape
# (a tuple of ints) and a dtype looked up by the dtype object, nothing to convert or check.
_TensorSpec = trusted(TensorSpec)
_NUMPY_DTYPES = {np.dtype(np.int64): DType.INT64, np.dtype(np.int32): DType.INT32}


def _spec(
    call: str, ref: BufferRef, shape: tuple[int, ...], dtype: DType | None, shown: object
) -> TensorSpec:
    """The spec of the tensor bound to `ref`; `dtype` is None when the tensor's dtype
    (`shown`, named in the error) is neither int64 nor int32."""
    if dtype is None:
        raise InterpreterError(
            call,
            f"buffer {ref.name!r} is {str(shown).removeprefix('torch.')}",
            "bind int64 or int32 tensors to relay inputs",
        )
    return _TensorSpec(shape=shape, dtype=dtype)


def _host_int32(call: str, values: object) -> npt.NDArray[Any]:
    """`values` when it is a host int32 array (a slot mapping); a typed error otherwise."""
    if not isinstance(values, np.ndarray) or values.dtype != np.int32:
        shown = (
            f"{with_article(str(values.dtype))} array"
            if isinstance(values, np.ndarray)
            else a_type(values)
        )
        raise InvalidInputError(
            call, f"values is {shown}, not an int32 array", "upload a numpy int32 array"
        )
    return values


def numpy_spec(call: str, ref: BufferRef, array: npt.NDArray[Any]) -> TensorSpec:
    """The spec of the numpy array bound to `ref`; an InterpreterError unless int64 or int32."""
    dtype = array.dtype
    return _spec(call, ref, array.shape, _NUMPY_DTYPES.get(dtype), dtype)


class NumpyIO:
    """Caller arrays bound in a `NumpyInterpreter` (the simulator's ranks, CPU tests)."""

    def __init__(self, interpreter: NumpyInterpreter) -> None:
        check_instance("NumpyIO", "interpreter", interpreter, NumpyInterpreter)
        self.interpreter = interpreter

    def bind(self, ref: BufferRef, value: npt.NDArray[Any], /) -> None:
        self.interpreter.bind(ref, value)

    def spec(self, ref: BufferRef, /) -> TensorSpec:
        return numpy_spec("NumpyIO.spec", ref, self.interpreter.tensor(ref))

    def upload(self, values: IntArray, /) -> npt.NDArray[Any]:
        return np.array(_host_int32("NumpyIO.upload", values), copy=True)

    def host_table(self, ref: BufferRef, /) -> IntArray:
        table: IntArray = self.interpreter.host_array(ref)
        return table


class TorchIO:
    """Caller tensors bound in a `TorchInterpreter` (CUDA or CPU)."""

    def __init__(self, interpreter: TorchInterpreter) -> None:
        import torch  # only when used

        from purepp.effects.torch_interpreter import TorchInterpreter

        check_instance("TorchIO", "interpreter", interpreter, TorchInterpreter)
        self.interpreter = interpreter
        self._dtypes = {torch.int64: DType.INT64, torch.int32: DType.INT32}

    def bind(self, ref: BufferRef, value: torch.Tensor, /) -> None:
        self.interpreter.bind(ref, value)

    def spec(self, ref: BufferRef, /) -> TensorSpec:
        tensor = self.interpreter.tensor(ref)
        dtype = tensor.dtype
        return _spec("TorchIO.spec", ref, tuple(tensor.shape), self._dtypes.get(dtype), dtype)

    def upload(self, values: IntArray, /) -> torch.Tensor:
        import torch

        host = torch.from_numpy(np.array(_host_int32("TorchIO.upload", values), copy=True))
        device = self.interpreter.device
        if device.type == "cpu":
            return host
        # Pinned, so the copy does not block the host (the seed's async_tensor_h2d).
        return host.pin_memory().to(device, non_blocking=True)

    def host_table(self, ref: BufferRef, /) -> IntArray:
        table: IntArray = self.interpreter.host_array(ref)
        return table
