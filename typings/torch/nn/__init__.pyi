# Narrow stubs for torch.nn: only the functional namespace.

from torch.nn import functional as functional
