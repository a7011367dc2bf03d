# Type stubs for torchdp._C, the pybind11 extension (see csrc/python/API.md).
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__version__: str

def has_cuda() -> bool: ...
def has_nccl() -> bool: ...
def cuda_device_count() -> int: ...

class _TestingModule:
    """torchdp._C._testing (csrc/python/bind_testing.cpp): support for torchdp's own tests."""

    has_process_group: bool
    def train_mlp(
        self,
        group: Any,
        init: Sequence[Tensor],
        batches: Sequence[tuple[Tensor, Tensor]],
        devices: Sequence[str],
        lr: float,
        accumulate: bool,
    ) -> list[Tensor]: ...

_testing: _TestingModule

def normalize_devices(devices: Sequence[torch.device], api: str) -> list[torch.device]: ...
def check_forward_context(api: str) -> None: ...
def check_output_device(
    devices: Sequence[torch.device], output: torch.device, api: str
) -> None: ...
def broadcast_coalesced(
    tensors: Sequence[Tensor],
    devices: Sequence[torch.device],
    buffer_size: int = 10485760,
    differentiable: bool = False,
) -> list[list[Tensor]]: ...
def reduce_add_coalesced(
    per_device: Sequence[Sequence[Tensor]],
    destination: torch.device,
    buffer_size: int = 10485760,
    differentiable: bool = False,
) -> list[Tensor]: ...
def scatter(
    tensor: Tensor,
    devices: Sequence[torch.device],
    chunk_sizes: Sequence[int] | None = None,
    dim: int = 0,
    differentiable: bool = True,
) -> list[Tensor]: ...
def gather(
    tensors: Sequence[Tensor],
    destination: torch.device,
    dim: int = 0,
    differentiable: bool = True,
) -> Tensor: ...
def parallel_apply(
    fns: Sequence[Callable[[], object]], devices: Sequence[torch.device], serial: bool = False
) -> list[object]: ...
def replicate(
    network: nn.Module,
    devices: Sequence[torch.device],
    detach: bool = False,
    grad_bucket_bytes: int | None = None,
    *,
    report: bool = False,
) -> Any: ...  # list[list[nn.Module]], or (that, plain_only) with report=True

class BufferSnapshot:
    def __init__(self) -> None: ...
    def take(self, tensors: Sequence[Tensor]) -> None: ...
    def restore(self) -> int: ...
    def release(self) -> None: ...
    def __len__(self) -> int: ...

def snapshot_buffers(network: nn.Module) -> BufferSnapshot: ...

class ReplicaCache:
    def __init__(self) -> None: ...
    def replicate(
        self,
        network: nn.Module,
        devices: Sequence[torch.device],
        detach: bool = False,
        grad_bucket_bytes: int | None = None,
    ) -> tuple[list[list[nn.Module]], bool, bool, BufferSnapshot]: ...
    def park(self) -> bool: ...
    def drop(self) -> None: ...
    @property
    def builds(self) -> int: ...
    @property
    def reuses(self) -> int: ...
    @property
    def state(self) -> str: ...

def check_group_and_graphs(process_group: bool, cuda_graphs: bool, api: str) -> None: ...
def check_cuda_graphs(devices: Sequence[torch.device], api: str) -> None: ...
def misplaced_module_message(
    target: torch.device, kind: str, name: str, found: torch.device, fix: str
) -> str: ...
def bucket_bytes_from_mib(mib: float, api: str) -> int: ...

class ProcessGroupSync:  # only when torchdp is built with c10d
    def __init__(self, group: Any, api: str) -> None: ...
    def agreed(self, params: Sequence[Tensor]) -> bool: ...
    def agree(
        self, params: Sequence[Tensor], buffers: Sequence[Tensor], sparse: Sequence[bool]
    ) -> None: ...
    def broadcast(self, tensors: Sequence[Tensor]) -> None: ...
    def watch(self, outputs: Sequence[Tensor], bucket_bytes: int | None) -> None: ...
    @property
    def remembered_passes(self) -> int: ...
    max_passes: int
    @property
    def reductions(self) -> int: ...

def misplaced_tensor(
    module: nn.Module, device: torch.device
) -> tuple[str, str, torch.device] | None: ...
def check_replica_devices(
    copies: Sequence[list[nn.Module]],
    devices: Sequence[torch.device],
    api: str = "torchdp.replicate",
) -> None: ...
