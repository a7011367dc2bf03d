"""torchdp: a drop-in replacement for ``torch.nn.DataParallel`` backed by a C++ (LibTorch) core."""

# torch first: _C links against libtorch_python and needs its Python types registered.
import os as _os  # isort: skip

import torch


def _check_torch_version() -> None:
    # libtorch's C++ ABI changes between releases: check the torch _C was built against first.
    try:
        from torchdp._build_info import cuda_version, torch_version
    except ImportError:  # a build that predates the record
        return
    if (torch_version, cuda_version) != (str(torch.__version__), torch.version.cuda):
        raise ImportError(
            f"torchdp was built against torch {torch_version} (CUDA {cuda_version or 'none'}), "
            f"but torch {torch.__version__} (CUDA {torch.version.cuda or 'none'}) is installed. "
            f"Install that torch ({_torch_install_command(torch_version)}), or rebuild torchdp "
            "against this torch: pip install -v --no-build-isolation --force-reinstall --no-deps "
            "<torchdp source folder>"
        )


def _torch_install_command(version: str) -> str:
    # Indexes serve the release, not the local tag: PyPI has no "+cu130" or "+cpu" builds; the
    # PyTorch index named after the tag serves exactly that build.
    release, _, local = version.partition("+")
    if not local:
        return f"pip install torch=={release}"
    return f"pip install torch=={release} --index-url https://download.pytorch.org/whl/{local}"


_check_torch_version()

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
from torchdp.scatter_gather import gather, scatter, scatter_kwargs, share_rows

#: The torchdp release, such as ``"0.1.0"`` (the version the extension was built as).
__version__: str = _C.__version__

#: The folder to add to ``CMAKE_PREFIX_PATH`` so that ``find_package(TorchDP)`` finds the C++
#: package (headers, core library, CMake files), as ``torch.utils.cmake_prefix_path`` does for
#: LibTorch. Only wheels (``pip install .``) carry it, not editable installs.
cmake_prefix_path: str = _os.path.join(_os.path.dirname(__file__), "lib", "cmake")


def has_cuda() -> bool:
    """True when torchdp was built with its CUDA fast paths and a CUDA device is visible."""
    return bool(_C.has_cuda())


def has_nccl() -> bool:
    """True when torchdp was built with its NCCL transport, whether or not a GPU is visible."""
    return bool(_C.has_nccl())


__all__ = [
    "DataParallel",
    "DataParallelCriterion",
    "PostReplicateHookHandle",
    "ReplicaContext",
    "TorchPatch",
    "__version__",
    "cmake_prefix_path",
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
    "share_rows",
]
