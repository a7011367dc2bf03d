"""Device lists and their checks, the batch dimension and module placement, for the Python layer."""

from __future__ import annotations

import operator
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch._utils import _get_devices_properties

from torchdp import _C

DeviceLike = int | str | torch.device


def _current_cuda_device(api: str) -> torch.device:
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"{api}: a CUDA device without an index (or None) means the current CUDA device, "
            "but CUDA is not available; pass an explicit device such as torch.device('cpu')"
        )
    return torch.device("cuda", torch.cuda.current_device())


def _to_device(device: Any, api: str) -> torch.device:
    """One device-list entry as a canonical device: ints are CUDA indices, ``cpu:0``/``meta:0``
    lose their index (as tensors report them), indexless CUDA or ``None`` is the current device."""
    if device is None:
        return _current_cuda_device(api)
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError as e:  # RuntimeError, as torch.device (and so torch.nn.parallel) raises
            raise RuntimeError(
                f"{api}: {device!r} is not a device: {e}; use e.g. 'cuda:0', 'cpu' or an int "
                "CUDA index"
            ) from e
    if isinstance(device, torch.device):
        if device.type in ("cpu", "meta"):
            return torch.device(device.type)
        if device.type == "cuda" and device.index is None:
            return _current_cuda_device(api)
        return device
    if isinstance(device, bool):
        raise TypeError(f"{api}: expected a device (int, str or torch.device), got {device!r}")
    try:
        index = operator.index(device)
    except TypeError:
        raise TypeError(
            f"{api}: expected a device (int, str or torch.device), got "
            f"{type(device).__qualname__} {device!r}"
        ) from None
    if index < 0:
        raise ValueError(
            f"{api}: device index {index} is negative; use a CUDA index >= 0, or "
            "torch.device('cpu') for the CPU"
        )
    return torch.device("cuda", index)


def _to_devices(devices: Sequence[Any], api: str) -> list[torch.device]:
    """:func:`_to_device` on each entry; repeated devices are kept."""
    if isinstance(devices, (str, torch.device, int)):
        raise TypeError(
            f"{api}: expected a list of devices, got a single device {devices!r}; "
            f"wrap it in a list: [{devices!r}]"
        )
    return [_to_device(d, api) for d in devices]


def _check_dim(dim: Any, api: str) -> int:
    """``dim`` as an int (numpy integers too), or a TypeError naming ``api``."""
    if not isinstance(dim, bool):
        try:
            return operator.index(dim)
        except TypeError:
            pass
    raise TypeError(
        f"{api}: dim must be an int (the batch dimension), got {type(dim).__qualname__} {dim!r}"
    )


def _check_shares(shares: Any, devices: int, api: str) -> list[float] | None:
    """``shares`` as a list of floats, checked against ``devices`` devices (Note [Uneven shares]
    in csrc/torchdp/shares.h); ``None`` stays ``None``. TypeError for what is not a sequence of
    real numbers, ValueError (from the C++ check) for shares that do not fit."""
    if shares is None:
        return None
    if isinstance(shares, torch.Tensor):
        shares = shares.tolist()
    values: list[float] = []
    if isinstance(shares, Sequence) and not isinstance(shares, (str, bytes)):
        for s in shares:
            if isinstance(s, bool) or not isinstance(s, (int, float)):
                break
            values.append(float(s))
        else:
            _C.share_rows(values, 0, devices, api)
            return values
    raise TypeError(
        f"{api}: shares must be a sequence of numbers, one per device (weights such as "
        f"[1, 2, 2, 2] or row counts), got {shares!r}"
    )


def _device_label(device: torch.device) -> int | str:
    """How ``torch.nn.parallel`` prints a device in messages: the index for CUDA devices."""
    if device.type == "cuda" and device.index is not None:
        return device.index
    return str(device)


_IMBALANCE_WARNING = """
    There is an imbalance between your GPUs. You may want to exclude GPU {} which
    has less than 75% of the memory or cores of GPU {}. You can do so by setting
    the device_ids argument to DataParallel, or by setting the CUDA_VISIBLE_DEVICES
    environment variable."""


def _check_balance(device_ids: Sequence[int]) -> None:
    """Warns (once) when a GPU has less than 75% of the memory, or else of the SMs, of another."""
    properties = _get_devices_properties(list(device_ids))
    for attribute in ("total_memory", "multi_processor_count"):
        values = [getattr(p, attribute) for p in properties]
        low = min(range(len(values)), key=values.__getitem__)
        high = max(range(len(values)), key=values.__getitem__)
        if values[low] / values[high] < 0.75:
            warnings.warn(
                _IMBALANCE_WARNING.format(device_ids[low], device_ids[high]), stacklevel=3
            )
            return


def _check_device_ids(device_ids: Sequence[int], output_device: int, api: str) -> None:
    """Fails on CUDA ids this process cannot use (output_device -1: the CPU) before PyTorch does."""
    checked = [("device_ids", list(device_ids))]
    if output_device != -1:
        checked.append(("output_device", [output_device]))
    for name, ids in checked:
        bad = [i for i in ids if i < 0]
        if bad:
            raise ValueError(
                f"{api}: {name} must hold CUDA device indices >= 0"
                + (" (or -1 for the CPU)" if name == "output_device" else "")
                + f", got {bad[0]}"
            )
    for name, ids in checked:
        _C.normalize_devices([torch.device("cuda", i) for i in ids], f"{api} ({name})")


def _resolve_explicit(
    devices: Sequence[DeviceLike], device_ids: Any, output_device: Any, api: str
) -> tuple[list[torch.device], Any]:
    """The ``devices=`` path: (device list, output device, which may be the CPU: 'cpu' or -1);
    refuses ``device_ids`` as well."""
    if device_ids is not None:
        raise ValueError(
            f"{api}: pass either device_ids= or devices=, not both "
            f"(got device_ids={device_ids!r} and devices={devices!r})"
        )
    device_list = _to_devices(devices, api)
    if not device_list:
        raise ValueError(f"{api}: devices= must name at least one device, got an empty list")
    if output_device is None:
        output = device_list[0]
    elif isinstance(output_device, int) and output_device == -1:  # a bool is never -1
        output = torch.device("cpu")
    else:
        output = _to_device(output_device, api)
    # CUDA devices that this process cannot use fail here, not at the first forward.
    _C.normalize_devices(device_list, api)
    _C.normalize_devices([output], f"{api} (output_device)")
    _C.check_output_device(device_list, output, api)
    return device_list, output


def _device_error(
    src_device: torch.device, found: tuple[str, str, torch.device], wrapper: bool
) -> RuntimeError:
    kind, name, device = found
    target = repr(str(src_device))
    if wrapper:
        fix = (
            f"call model.to({target}) (or .to({target}) on the DataParallel wrapper) before the "
            "forward, or pass place_module=True to torchdp.DataParallel to have it moved at the "
            "first forward"
        )
    else:
        fix = f"call module.to({target}) before data_parallel()"
    return RuntimeError(_C.misplaced_module_message(src_device, kind, name, device, f"Fix: {fix}."))
