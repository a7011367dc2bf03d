# Type stubs and interface spec of torchdp._C, the pybind11 extension (csrc/python/*.cpp). GIL:
# the transport functions, DataParallel's checks and ProcessGroupSync release it while C++ works,
# parallel_apply while it waits; those walking nn.Modules hold it (replicate but for its broadcast).
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

__version__: str

def has_cuda() -> bool: ...
def has_nccl() -> bool: ...
def cuda_device_count() -> int: ...

# RuntimeError with torchdp's message (naming `api`) for an empty list or an unusable device.
def normalize_devices(devices: Sequence[torch.device], api: str) -> list[torch.device]: ...
def check_forward_context(api: str) -> None: ...
def check_output_device(
    devices: Sequence[torch.device], output: torch.device, api: str
) -> None: ...

# differentiable=False: torchdp::comm::broadcast_coalesced; True: torchdp::autograd's.
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

# May return fewer chunks than devices (tensor.chunk's rule without chunk_sizes).
def scatter(
    tensor: Tensor,
    devices: Sequence[torch.device],
    chunk_sizes: Sequence[int] | None = None,
    dim: int = 0,
    differentiable: bool = True,
) -> list[Tensor]: ...

# All-0-dim inputs along dim 0: a vector and PyTorch's UserWarning (differentiable=False raises).
# pad_value: tensors that differ in other dims are padded at their end to the largest size.
def gather(
    tensors: Sequence[Tensor],
    destination: torch.device,
    dim: int = 0,
    differentiable: bool = True,
    pad_value: complex | None = None,
) -> Tensor: ...

# scatter() of every tensor: one list of chunks per replica, as many as the fewest chunks.
def scatter_leaves(
    tensors: Sequence[Tensor], devices: Sequence[torch.device], dim: int = 0
) -> list[list[Tensor]]: ...

# Note [Uneven shares]: the rows of a batch each device gets; ValueError naming api.
def share_rows(shares: Sequence[float], rows: int, devices: int, api: str) -> list[int]: ...

# scatter_leaves by shares: (index, per_replica), replica i on devices[index[i]].
def scatter_shares(
    tensors: Sequence[Tensor],
    devices: Sequence[torch.device],
    shares: Sequence[float],
    dim: int,
    api: str,
) -> tuple[list[int], list[list[Tensor]]]: ...

# Split by item (Note [Lists of samples]): (index, begin, count, per_replica), replica i on
# devices[index[i]] with items begin[i]:begin[i] + count[i], None for other replicas' items.
def scatter_items(
    tensors: Sequence[Tensor],
    item_of: Sequence[int],
    items: int,
    devices: Sequence[torch.device],
    shares: Sequence[float] | None,
    dim: int,
    api: str,
    names: Sequence[str],
) -> tuple[list[int], list[int], list[int], list[list[Tensor | None]]]: ...

# ValueError for a list of tensors, given as (name, shapes), that cannot be one batch.
def check_batch_lists(
    lists: Sequence[tuple[str, Sequence[Sequence[int]]]],
    devices: int,
    dim: int,
    api: str,
    option: str,
) -> None: ...

# The replicas' per-sample tensors in one list on destination, in order.
def gather_samples(
    outputs: Sequence[Sequence[Tensor]], destination: torch.device
) -> list[Tensor]: ...

# gather() of each group (one tensor per replica), differentiably, padded as gather().
def gather_leaves(
    groups: Sequence[Sequence[Tensor]],
    destination: torch.device,
    dim: int = 0,
    pad_value: complex | None = None,
) -> list[Tensor]: ...

# fns[i]() on worker i (fns[0], or all with serial=True, on the caller) with devices[i] and the
# caller's stream/grad/autocast state; re-raises the lowest-index exception as is, Ctrl-C at once.
def parallel_apply(
    fns: Sequence[Callable[[], object]], devices: Sequence[torch.device], serial: bool = False
) -> list[object]: ...

# result[j][p]: replica on devices[j] of list(network.modules())[p]; plain_only: no tensor can be
# misplaced but by hooks (run in replicate.py). RuntimeError: Python modules below a ScriptModule.
def replicate(
    network: nn.Module,
    devices: Sequence[torch.device],
    detach: bool = False,
    grad_bucket_bytes: int | None = None,
    *,
    report: bool = False,
) -> Any: ...  # list[list[nn.Module]], or (that, plain_only) with report=True

# A copy of tensors (meta and expanded ones skipped) that restore() writes back, returning how
# many; take() of the same tensors refreshes it in place (Note [Buffers of failed forwards]).
class BufferSnapshot:
    def __init__(self) -> None: ...
    def take(self, tensors: Sequence[Tensor]) -> None: ...
    def restore(self) -> int: ...
    def release(self) -> None: ...
    def __len__(self) -> int: ...

def snapshot_buffers(network: nn.Module) -> BufferSnapshot: ...  # network.buffers(), as walked

# `with EnclosingForward(snapshot):` the replicas run inside belong to snapshot's forward: a
# DataParallel nested in them is not a concurrent forward (Note [Nested forwards]).
class EnclosingForward:
    def __init__(self, snapshot: BufferSnapshot) -> None: ...
    def __enter__(self) -> None: ...
    def __exit__(self, *args: object) -> None: ...

# The CUDA-graph engine of cuda_graphs=True (Note [Graphed replicas]); RuntimeError without CUDA.
class GraphedSteps:
    def __init__(self, devices: Sequence[torch.device], max_signatures: int, api: str) -> None: ...
    # Per replica, the (params, buffers) to install in it.
    def rebuild(
        self, params: Sequence[Tensor], buffers: Sequence[Tensor], n: int
    ) -> list[tuple[list[Tensor], list[Tensor]]]: ...
    # Replica j's leaves for the parameters that require grad.
    def bind(self, j: int, grad_leaves: Sequence[Tensor]) -> None: ...
    # key + the inputs' metadata, grad mode and autocast state.
    def signature(self, key: str, inputs: Sequence[Sequence[Tensor]]) -> str: ...
    # forward(j, tensors) runs replica j, captured; None: run eagerly. GIL released but in forward.
    def run(
        self,
        signature: str,
        inputs: Sequence[Sequence[Tensor]],
        forward: Callable[[int, list[Tensor]], list[Tensor]],
    ) -> list[list[Tensor]] | None: ...
    @property
    def replicas(self) -> int: ...
    @property
    def captures_made(self) -> int: ...

# The replicas one torchdp.DataParallel keeps between forwards (Note [Kept replicas]).
class ReplicaCache:
    def __init__(self) -> None: ...
    # As replicate(report=True), plus reused and a snapshot of the buffers taken before the
    # transfer; lent until park(); reuses parked replicas of the same classes, order and devices.
    def replicate(
        self,
        network: nn.Module,
        devices: Sequence[torch.device],
        detach: bool = False,
        grad_bucket_bytes: int | None = None,
    ) -> tuple[list[list[nn.Module]], bool, bool, BufferSnapshot]: ...
    # Keeps (and empties) the replicas if only the cache and they refer to them, else forgets them.
    def park(self) -> bool: ...
    def drop(self) -> None: ...
    @property
    def builds(self) -> int: ...
    @property
    def reuses(self) -> int: ...
    @property
    def state(self) -> str: ...  # 'empty', 'lent' or 'parked'

# DataParallel's checks, made in C++ (csrc/python/bind_data_parallel.cpp).
def check_group_and_graphs(process_group: bool, cuda_graphs: bool, api: str) -> None: ...
def check_cuda_graphs(devices: Sequence[torch.device], api: str) -> None: ...

# ValueError when chunks (fewer than n devices) would drop rows of a longer tensor; sizes are the
# (name, size along dim) of the tensors split.
def check_chunks(
    sizes: Sequence[tuple[str, int]], chunks: int, n: int, dim: int, api: str
) -> None: ...
def misplaced_module_message(
    target: torch.device, kind: str, name: str, found: torch.device, fix: str
) -> str: ...
def bucket_bytes_from_mib(mib: float, api: str) -> int: ...  # ValueError unless finite and >= 0
def loss_reductions() -> list[str]: ...  # "mean", "batchmean", "sum", "none"
def loss_reduction(name: object, api: str) -> str: ...  # ValueError naming api and the choices

# The engine of DataParallel(process_group=...) (Note [Reducing across processes]).
class ProcessGroupSync:  # only when torchdp is built with c10d
    def __init__(self, group: Any, api: str) -> None: ...
    # Same tensors, requires_grad, dtypes and devices as last agreed.
    def agreed(self, params: Sequence[Tensor]) -> bool: ...
    # RuntimeError unless every process holds the same module; takes rank 0's values.
    def agree(
        self, params: Sequence[Tensor], buffers: Sequence[Tensor], sparse: Sequence[bool]
    ) -> None: ...
    def broadcast(self, tensors: Sequence[Tensor]) -> None: ...  # rank 0's values
    # Hooks outputs so that the backward through them averages the gradients.
    def watch(self, outputs: Sequence[Tensor], bucket_bytes: int | None) -> None: ...
    @property
    def remembered_passes(self) -> int: ...
    max_passes: int
    @property
    def reductions(self) -> int: ...

# None when every parameter and buffer is on `device`, else the first that is not, as (kind,
# qualified name, device): DataParallel's per-forward check.
def misplaced_tensor(
    module: nn.Module, device: torch.device
) -> tuple[str, str, torch.device] | None: ...

# RuntimeError naming the first registered tensor of the tree at copies[j][0] not on devices[j].
def check_replica_devices(
    copies: Sequence[list[nn.Module]],
    devices: Sequence[torch.device],
    api: str = "torchdp.replicate",
) -> None: ...
