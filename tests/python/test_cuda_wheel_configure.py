"""The CMake configure step against a CUDA build of torch (pip's default wheel) whatever CUDA
toolkit the machine has: none (a laptop, a CPU runner), a partial one (an nvcc without the
libraries torch's config looks for), one of another CUDA release than torch's, or the machine's
own. torchdp uses a toolkit torch's config accepts, else compiles its CUDA fast paths against the
CUDA runtime of torch's release (pip's nvidia packages), else builds without them and says how to
get them; never torch's own "cannot find the CUDA libraries" error. See Note [A CUDA build of
torch and the CUDA toolkit] in cmake/TorchDPTorchCUDA.cmake.

tests/consumer/without_cuda_toolkit.sh hides the machine's toolkit (a private mount namespace);
the partial and mismatched toolkits are a fake nvcc put first on PATH inside it."""

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


def fake_nvcc(tmp_path: pathlib.Path, release: str) -> pathlib.Path:
    """A toolkit folder with only an nvcc that reports CUDA `release`: no headers, no libraries."""
    bin_dir = tmp_path / f"cuda-{release}" / "bin"
    bin_dir.mkdir(parents=True)
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        f"  --version) echo 'Cuda compilation tools, release {release}, V{release}.0'; exit 0;;\n"
        f"  --dryrun) echo '#$ _HERE_={bin_dir}' >&2; exit 0;;\n"
        "esac\n"
        "echo 'nvcc: not a real compiler' >&2; exit 1\n"
    )
    nvcc.chmod(0o755)
    return bin_dir


def other_release() -> str:
    """A CUDA release that is not torch's."""
    return "12.4" if not torch.version.cuda.startswith("12.4") else "13.0"


def configure(
    tmp_path: pathlib.Path, *args: str, hide_toolkit: bool = True, path_first: str | None = None
) -> subprocess.CompletedProcess[str]:
    build = tmp_path / "build"
    shutil.rmtree(build, ignore_errors=True)
    wrapper = ["bash", str(HIDE_TOOLKIT)] if hide_toolkit else []
    if path_first is not None:  # after the toolkit is hidden, so that the fake stays visible
        wrapper += ["env", f"PATH={path_first}:{os.environ['PATH']}"]
    command = [
        *wrapper, "cmake", "-S", str(ROOT), "-B", str(build),
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


def test_a_toolkit_of_another_release_is_left_alone(tmp_path):
    release = other_release()
    result = configure(
        tmp_path, *hide_pip_cuda_include(), path_first=str(fake_nvcc(tmp_path, release))
    )
    assert result.returncode == 0, result.stdout
    assert f"is CUDA {release}, torch is built with CUDA {torch.version.cuda}" in result.stdout
    assert "torchdp: building without its CUDA fast paths" in result.stdout
    assert 'pip install "nvidia-cuda-crt==' in result.stdout
    assert "torchdp: CUDA fast paths OFF, NCCL OFF" in result.stdout


def test_a_partial_toolkit_of_torchs_release_is_tried_then_left_alone(tmp_path):
    bin_dir = fake_nvcc(tmp_path, torch.version.cuda)
    result = configure(tmp_path, *hide_pip_cuda_include(), path_first=str(bin_dir))
    assert result.returncode == 0, result.stdout
    assert "checking that torch's CUDA config accepts the CUDA toolkit" in result.stdout
    assert f"the CUDA {torch.version.cuda} toolkit of {bin_dir}/nvcc" in result.stdout
    assert "is incomplete for torch's CMake config" in result.stdout
    assert "torchdp: building without its CUDA fast paths" in result.stdout
    assert "torchdp: CUDA fast paths OFF, NCCL OFF" in result.stdout


def test_cuda_off_ignores_a_partial_toolkit(tmp_path):
    bin_dir = fake_nvcc(tmp_path, torch.version.cuda)
    result = configure(tmp_path, "-DTORCHDP_WITH_CUDA=OFF", path_first=str(bin_dir))
    assert result.returncode == 0, result.stdout
    assert "checking that torch's CUDA config" not in result.stdout
    assert "torchdp: CUDA fast paths OFF, NCCL OFF" in result.stdout
    assert "building without its CUDA fast paths" not in result.stdout


def test_the_machine_as_it_is_configures(tmp_path):
    """Whatever toolkit this machine has, whole, partial or of another release."""
    result = configure(tmp_path, hide_toolkit=False)
    assert result.returncode == 0, result.stdout
    assert "torchdp: CUDA fast paths" in result.stdout
