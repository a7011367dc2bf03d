"""The CMake configure step against a CUDA build of torch on a machine without the CUDA toolkit
(pip's default torch wheel on a laptop or a CPU runner): torchdp either compiles its CUDA fast
paths against the CUDA runtime of pip's nvidia packages, or builds without them and says how to
get them; never torch's own "cannot find the CUDA libraries" error. See Note [A CUDA build of
torch without the CUDA toolkit] in cmake/TorchDPTorchCUDA.cmake.

tests/consumer/without_cuda_toolkit.sh hides the toolkit (a private mount namespace)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch
import torch.utils

ROOT = pathlib.Path(__file__).resolve().parents[2]
HIDE_TOOLKIT = ROOT / "tests" / "consumer" / "without_cuda_toolkit.sh"
TORCH_ERROR = "Your installed Caffe2 version uses CUDA but I cannot find the CUDA"

pytestmark = pytest.mark.skipif(
    torch.version.cuda is None, reason="torch is a CPU build: no CUDA configure step to check"
)


def pip_cuda_include() -> pathlib.Path | None:
    """The folder of pip's CUDA runtime headers next to torch, when they are complete."""
    nvidia = pathlib.Path(torch.__file__).parent.parent / "nvidia"
    for include in sorted(nvidia.glob("*/include")):
        headers = (include / "cuda_runtime_api.h", include / "crt" / "host_defines.h")
        if all(header.is_file() for header in headers):
            return include
    return None


def configure(tmp_path: pathlib.Path, *args: str) -> subprocess.CompletedProcess[str]:
    build = tmp_path / "build"
    shutil.rmtree(build, ignore_errors=True)
    command = [
        "bash", str(HIDE_TOOLKIT), "cmake", "-S", str(ROOT), "-B", str(build),
        f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
        f"-DPython3_EXECUTABLE={sys.executable}",
        "-DTORCHDP_BUILD_TESTS=OFF", "-DTORCHDP_BUILD_EXAMPLES=OFF", "-DTORCHDP_INSTALL=OFF",
        *args,
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "CMAKE_ARGS"}
    result = subprocess.run(
        command, check=False, capture_output=True, text=True, env=env, timeout=600
    )
    result.stdout += result.stderr
    assert TORCH_ERROR not in result.stdout, result.stdout
    # CMake wraps long messages: compare without the line breaks.
    result.stdout = " ".join(result.stdout.split())
    return result


def hide_pip_cuda_include() -> list[str]:
    """CMake arguments that hide pip's CUDA runtime headers, as where nvidia-cuda-crt is missing."""
    include = pip_cuda_include()
    return [f"-DCMAKE_IGNORE_PATH={include}"] if include is not None else []


def test_auto_without_cuda_runtime_builds_without_cuda_and_says_how(tmp_path):
    result = configure(tmp_path, *hide_pip_cuda_include())
    assert result.returncode == 0, result.stdout
    assert "torchdp: building without its CUDA fast paths" in result.stdout
    assert "no CUDA toolkit (nvcc) was found" in result.stdout
    assert 'pip install "nvidia-cuda-crt==' in result.stdout
    assert "torchdp: CUDA fast paths OFF, NCCL OFF" in result.stdout


def test_auto_with_pip_cuda_runtime_builds_cuda(tmp_path):
    if pip_cuda_include() is None:
        pytest.skip("pip's CUDA headers are incomplete here (nvidia-cuda-crt is not installed)")
    result = configure(tmp_path)
    assert result.returncode == 0, result.stdout
    assert "runtime of pip's nvidia packages" in result.stdout
    assert "torchdp: CUDA fast paths ON" in result.stdout
    assert "building without its CUDA fast paths" not in result.stdout


def test_cuda_off_builds_quietly(tmp_path):
    result = configure(tmp_path, "-DTORCHDP_WITH_CUDA=OFF")
    assert result.returncode == 0, result.stdout
    assert "torchdp: CUDA fast paths OFF, NCCL OFF" in result.stdout
    assert "building without its CUDA fast paths" not in result.stdout


def test_cuda_on_without_cuda_runtime_fails_clearly(tmp_path):
    result = configure(tmp_path, "-DTORCHDP_WITH_CUDA=ON", *hide_pip_cuda_include())
    assert result.returncode != 0, result.stdout
    assert "TORCHDP_WITH_CUDA=ON: torch in" in result.stdout
    assert "no CUDA toolkit (nvcc) was found" in result.stdout
    assert 'pip install "nvidia-cuda-crt==' in result.stdout
