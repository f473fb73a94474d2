# Narrow stubs for torch.nn.functional.

from collections.abc import Sequence

from torch import Tensor

def pad(
    input: Tensor, pad: Sequence[int], mode: str = "constant", value: float | None = None
) -> Tensor: ...
