# Narrow stubs for torch.distributed: process groups and the two collectives purepp issues.

from collections.abc import Sequence
from datetime import timedelta
from typing import ClassVar, Literal, overload

from torch import Tensor, _Device

class DistError(RuntimeError): ...
class DistBackendError(DistError): ...

class Work:
    def wait(self, timeout: timedelta = ...) -> bool: ...
    def is_completed(self) -> bool: ...

class ReduceOp:
    SUM: ClassVar[ReduceOp]
    MAX: ClassVar[ReduceOp]
    MIN: ClassVar[ReduceOp]

class BroadcastOptions:
    rootRank: int
    rootTensor: int
    asyncOp: bool
    def __init__(self) -> None: ...

class AllreduceOptions:
    reduceOp: ReduceOp
    asyncOp: bool
    def __init__(self) -> None: ...

class ProcessGroup:
    def rank(self) -> int: ...
    def size(self) -> int: ...
    # The collectives dist.broadcast and dist.all_reduce issue, called directly.
    # None: a blocking call (asyncOp False) the backend already synchronised (NCCL).
    def broadcast(self, tensors: list[Tensor], opts: BroadcastOptions) -> Work | None: ...
    def allreduce(self, tensors: list[Tensor], opts: AllreduceOptions) -> Work | None: ...

class GroupMember:
    WORLD: ClassVar[ProcessGroup | None]
    NON_GROUP_MEMBER: ClassVar[int]  # what new_group returns on a rank outside the group

def is_available() -> bool: ...
def is_initialized() -> bool: ...
def is_nccl_available() -> bool: ...
def init_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    group_name: str = "",
    device_id: _Device | None = None,
) -> None: ...
@overload
def new_group(
    ranks: None = None,
    timeout: timedelta | None = None,
    backend: str | None = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
) -> ProcessGroup: ...  # every rank of the world, so always a member
@overload
def new_group(
    ranks: Sequence[int],
    timeout: timedelta | None = None,
    backend: str | None = None,
    use_local_synchronization: bool = False,
    group_desc: str | None = None,
) -> ProcessGroup | int: ...  # GroupMember.NON_GROUP_MEMBER on a rank outside `ranks`
def destroy_process_group(group: ProcessGroup | None = None) -> None: ...
def get_rank(group: ProcessGroup | None = None) -> int: ...
def get_world_size(group: ProcessGroup | None = None) -> int: ...
def get_backend(group: ProcessGroup | None = None) -> str: ...
def get_process_group_ranks(group: ProcessGroup | None) -> list[int]: ...
def get_group_rank(group: ProcessGroup, global_rank: int) -> int: ...
@overload
def broadcast(
    tensor: Tensor, src: int, group: ProcessGroup | None = None, async_op: Literal[False] = False
) -> None: ...
@overload
def broadcast(
    tensor: Tensor, src: int, group: ProcessGroup | None = None, *, async_op: Literal[True]
) -> Work: ...
@overload
def all_reduce(
    tensor: Tensor,
    op: ReduceOp = ...,
    group: ProcessGroup | None = None,
    async_op: Literal[False] = False,
) -> None: ...
@overload
def all_reduce(
    tensor: Tensor,
    op: ReduceOp = ...,
    group: ProcessGroup | None = None,
    *,
    async_op: Literal[True],
) -> Work: ...
@overload
def all_reduce(
    tensor: Tensor, op: ReduceOp = ..., group: ProcessGroup | None = None, *, async_op: bool
) -> Work | None: ...
def send(tensor: Tensor, dst: int, group: ProcessGroup | None = None, tag: int = 0) -> None: ...
def recv(
    tensor: Tensor, src: int | None = None, group: ProcessGroup | None = None, tag: int = 0
) -> int: ...
def gather_object(
    obj: object,
    object_gather_list: list[object] | None = None,
    dst: int | None = None,
    group: ProcessGroup | None = None,
) -> None: ...
def barrier(
    group: ProcessGroup | None = None,
    async_op: Literal[False] = False,
    timeout: timedelta | None = None,
) -> None: ...
