"""The build records the torch it was compiled against, and `import torchdp` refuses another."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch

import torchdp


def test_build_records_the_running_torch() -> None:
    from torchdp import _build_info

    assert _build_info.torch_version == str(torch.__version__)
    assert _build_info.cuda_version == torch.version.cuda


@pytest.mark.parametrize("attribute", ["__version__", "version.cuda"])
def test_import_refuses_another_torch(attribute: str) -> None:
    fake = "0.0.1+other" if attribute == "__version__" else "99.9"
    code = f"import torch\ntorch.{attribute} = {fake!r}\nimport torchdp\n"
    result = subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        capture_output=True,
        text=True,
        env=dict(os.environ),
    )
    assert result.returncode != 0
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("ImportError: torchdp was built against torch"), message
    assert fake in message
    assert str(torch.__version__ if attribute == "version.cuda" else fake) in message
    assert "--no-build-isolation" in message


def test_cmake_prefix_path() -> None:
    path = pathlib.Path(torchdp.cmake_prefix_path)
    assert path == pathlib.Path(torchdp.__file__).parent / "lib" / "cmake"
