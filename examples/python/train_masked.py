"""Train a model with a cplxmodule-style masked layer through ``torchdp.DataParallel``.

The masked layer keeps its ``mask`` as a registered buffer and overrides ``__setattr__`` so that
assigning ``layer.mask = m`` *copies into* the existing mask instead of re-registering it (the
pattern that breaks ``torch.nn.DataParallel``: replica 1 keeps the device-0 mask and fails with
"expected device cuda:1 but got device cuda:0"). torchdp notices that the assignment was swallowed,
puts each replica's own copy in place (with a one-time warning) and never writes the original.

The same model is trained on one device with the same batches; at the end the weights must match.

Usage::

    python examples/python/train_masked.py                 # all GPUs, or [cpu, cpu] without GPUs
    python examples/python/train_masked.py --devices cpu,cpu,cpu --steps 100
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
import warnings

import torch
from torch import nn

import torchdp


class MaskedLinear(nn.Linear):
    """A linear layer whose weight is multiplied by a 0/1 mask buffer."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        generator = torch.Generator().manual_seed(1234)
        self.mask = (torch.rand(out_features, in_features, generator=generator) > 0.25).float()

    def __setattr__(self, name: str, value) -> None:
        if name == "mask" and "mask" in self._buffers and self._buffers["mask"] is not None:
            # cplxmodule's pattern: copy into the existing mask instead of re-registering it.
            with torch.no_grad():
                self._buffers["mask"].copy_(value)
            return
        if name == "mask":
            self.register_buffer("mask", value)
            return
        super().__setattr__(name, value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight * self.mask, self.bias)


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(16, 64), nn.Tanh(), MaskedLinear(64, 32), nn.Tanh(), MaskedLinear(32, 1)
    )


def parse_devices(text: str | None) -> list[torch.device]:
    if text:
        return [torch.device(d.strip()) for d in text.split(",") if d.strip()]
    if torch.cuda.is_available() and torchdp.has_cuda():
        return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return [torch.device("cpu"), torch.device("cpu")]


def progress(step: int, total: int, loss_dp: float, loss_single: float, started: float) -> None:
    width = 30
    done = int(width * step / total)
    bar = "#" * done + "-" * (width - done)
    rate = step / max(time.perf_counter() - started, 1e-9)
    sys.stdout.write(
        f"\r[{bar}] {step:4d}/{total}  loss {loss_dp:.4f} (dp) {loss_single:.4f} "
        f"(single)  {rate:6.1f} steps/s"
    )
    sys.stdout.flush()
    if step == total:
        sys.stdout.write("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", help="comma-separated devices, e.g. cuda:0,cuda:1 or cpu,cpu")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args(argv)
    if args.steps <= 0 or args.batch <= 0:
        parser.error("--steps and --batch must be positive")
    devices = parse_devices(args.devices)
    print(
        f"torchdp {torchdp.__version__}: training on {[str(d) for d in devices]} "
        f"({args.steps} steps, batch {args.batch})"
    )

    torch.manual_seed(0)
    single = make_model().to(devices[0])
    parallel_model = copy.deepcopy(single)
    dp = torchdp.DataParallel(parallel_model, devices=devices)
    opt_single = torch.optim.SGD(single.parameters(), lr=0.05)
    opt_dp = torch.optim.SGD(dp.parameters(), lr=0.05)

    generator = torch.Generator().manual_seed(1)
    w_true = torch.randn(16, 1, generator=generator)
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(1, args.steps + 1):
            x = torch.randn(args.batch, 16, generator=generator)
            y = torch.sin(x @ w_true) + 0.05 * torch.randn(args.batch, 1, generator=generator)
            x, y = x.to(devices[0]), y.to(devices[0])
            losses = []
            for model, opt in ((dp, opt_dp), (single, opt_single)):
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            if step % max(1, args.steps // 50) == 0 or step == args.steps:
                progress(step, args.steps, losses[0], losses[1], started)
    repaired = {
        str(w.message).split(":")[1].strip()
        for w in caught
        if "did not store the replica's" in str(w.message)
    }
    for note in sorted(repaired):
        print(f"note: torchdp repaired a swallowed assignment: {note.split(' did not')[0]}")

    max_diff = max(
        (a - b).abs().max().item()
        for a, b in zip(parallel_model.parameters(), single.parameters(), strict=True)
    )
    masks_kept = all(
        torch.equal(a.mask, b.mask)
        for a, b in zip(
            (m for m in parallel_model.modules() if isinstance(m, MaskedLinear)),
            (m for m in single.modules() if isinstance(m, MaskedLinear)),
            strict=True,
        )
    )
    if max_diff <= 1e-4 and masks_kept:
        print(
            f"OK: DataParallel weights match single-device training (max abs diff {max_diff:.2e})"
        )
        return 0
    print(
        f"FAIL: weights differ from single-device training (max abs diff {max_diff:.2e}, "
        f"masks unchanged: {masks_kept})"
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
