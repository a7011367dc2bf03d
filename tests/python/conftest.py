"""Shared pytest configuration for torchdp's Python tests.

Markers:
    needs_cuda: needs at least one CUDA device and a CUDA build of torchdp.
    needs_multi_gpu: needs at least two CUDA devices.

Without the devices these tests are skipped, except when TORCHDP_REQUIRE_CUDA=1 (the GPU run),
where they fail, so that a misconfigured GPU machine cannot pass silently.

TORCHDP_REQUIRE_GIL_OFF=1 (make test-freethreaded) needs a free-threaded Python whose GIL stays off
for the whole session: the first test before or in which it is on stops the run, naming it. A
module that does not declare free-threading support turns the GIL on for good when imported, even
when the import fails or its warning is caught, so warnings filters alone do not catch it.
"""

from __future__ import annotations

import os
import sys
import sysconfig

import pytest
import torch

# The helpers module next to this file, importable whatever pytest's import mode is.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dp_testing import cpu_devices, cuda_devices

REQUIRE_CUDA = os.environ.get("TORCHDP_REQUIRE_CUDA", "") == "1"
REQUIRE_GIL_OFF = os.environ.get("TORCHDP_REQUIRE_GIL_OFF", "") == "1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "needs_cuda: needs a CUDA device")
    config.addinivalue_line("markers", "needs_multi_gpu: needs at least two CUDA devices")
    if REQUIRE_GIL_OFF and not sysconfig.get_config_var("Py_GIL_DISABLED"):
        raise pytest.UsageError(
            f"TORCHDP_REQUIRE_GIL_OFF=1 needs a free-threaded Python, not {sys.executable}"
        )


__all__ = ["cpu_devices", "cuda_devices"]


def _cuda_build() -> bool:
    try:
        import torchdp

        return torchdp.has_cuda()
    except Exception:  # the extension is missing: the import error shows in every test anyway
        return False


def _missing_requirement(item: pytest.Item) -> str | None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if item.get_closest_marker("needs_multi_gpu") is not None and count < 2:
        return f"needs at least 2 CUDA devices, {count} visible"
    if item.get_closest_marker("needs_cuda") is not None and count < 1:
        return "needs a CUDA device, none visible"
    if (
        item.get_closest_marker("needs_multi_gpu") or item.get_closest_marker("needs_cuda")
    ) and not _cuda_build():
        return "torchdp was built without CUDA (torchdp.has_cuda() is False)"
    return None


@pytest.fixture(autouse=True)
def _cuda_requirements(request: pytest.FixtureRequest) -> None:
    """Skips CUDA tests without devices, or fails them when TORCHDP_REQUIRE_CUDA=1."""
    reason = _missing_requirement(request.node)
    if reason is None:
        return
    if REQUIRE_CUDA:
        pytest.fail(f"TORCHDP_REQUIRE_CUDA=1 but this test {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(autouse=True)
def _gil_stays_off(request: pytest.FixtureRequest):
    """With TORCHDP_REQUIRE_GIL_OFF=1, stops the session at the first test that finds the GIL on."""
    if REQUIRE_GIL_OFF and sys._is_gil_enabled():
        pytest.exit(f"the GIL is on before {request.node.nodeid} (at collection or import)", 1)
    yield
    if REQUIRE_GIL_OFF and sys._is_gil_enabled():
        pytest.exit(
            f"the GIL came on during {request.node.nodeid}: a module it imported does not "
            "declare free-threading support (python -W error::RuntimeWarning names it)",
            1,
        )


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(name="cpu_devices")
def cpu_devices_fixture():
    """The :func:`cpu_devices` helper as a fixture: ``cpu_devices(3)``."""
    return cpu_devices
