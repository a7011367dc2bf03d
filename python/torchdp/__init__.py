"""torchdp: a drop-in replacement for ``torch.nn.DataParallel`` backed by a C++ (LibTorch) core.

``import torchdp`` gives the same API as ``torch.nn.parallel`` (``DataParallel``,
``data_parallel``, ``replicate``, ``scatter``, ``scatter_kwargs``, ``gather``,
``parallel_apply``), plus post-replicate hooks (``register_post_replicate_hook``), explicit CPU
and meta device lists (``devices=``), per-replica outputs and losses (``gather_output=False`` with
``DataParallelCriterion``), a check of unregistered replica state (``stale_attributes=``) and
:func:`patch_torch` to swap torchdp in for PyTorch's names.

Example::

    >>> import torch, torchdp
    >>> model = torchdp.DataParallel(torch.nn.Linear(8, 4).cuda(), device_ids=[0, 1])
    >>> out = model(torch.randn(32, 8))
"""

# torch must be imported before the extension: _C links against libtorch_python and needs its
# Python types (THPVariableClass) registered.
import torch  # noqa: F401  isort: skip

from torchdp import _C  # isort: skip

from torchdp.criterion import DataParallelCriterion
from torchdp.data_parallel import DataParallel, data_parallel
from torchdp.hooks import (
    PostReplicateHookHandle,
    ReplicaContext,
    register_post_replicate_hook,
)
from torchdp.parallel_apply import parallel_apply
from torchdp.patch import TorchPatch, patch_torch
from torchdp.replicate import replicate
from torchdp.scatter_gather import gather, scatter, scatter_kwargs

__version__: str = _C.__version__


def has_cuda() -> bool:
    """True when torchdp was built with its CUDA fast paths and a CUDA device is visible."""
    return bool(_C.has_cuda())


def has_nccl() -> bool:
    """True when torchdp was built with its NCCL transport."""
    return bool(_C.has_nccl())


__all__ = [
    "DataParallel",
    "DataParallelCriterion",
    "PostReplicateHookHandle",
    "ReplicaContext",
    "TorchPatch",
    "__version__",
    "data_parallel",
    "gather",
    "has_cuda",
    "has_nccl",
    "parallel_apply",
    "patch_torch",
    "register_post_replicate_hook",
    "replicate",
    "scatter",
    "scatter_kwargs",
]
