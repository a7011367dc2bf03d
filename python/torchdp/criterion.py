"""``torchdp.DataParallelCriterion``: each replica's loss on its device, so only scalars travel."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from torchdp import _C
from torchdp._devices import DeviceLike, _check_dim, _to_device
from torchdp.parallel_apply import get_a_var, record_function
from torchdp.replicate import replicate
from torchdp.scatter_gather import gather, scatter_kwargs

__all__ = ["DataParallelCriterion"]

_API = "torchdp.DataParallelCriterion"


class DataParallelCriterion(nn.Module):
    r"""Computes the loss of each replica on its device from the per-replica outputs of
    ``torchdp.DataParallel(..., gather_output=False)`` and combines the losses on one device.

    The targets (the arguments after ``outputs``) are split like the inputs, with ``torch.chunk``
    along :attr:`dim`, and moved to their outputs' devices, where
    ``criterion(output_i, *targets_i, **kwargs_i)`` runs (a module criterion with parameters or
    buffers is replicated first). The losses are combined on :attr:`output_device`:

    * ``"mean"``: the whole batch's mean. ``nn.CrossEntropyLoss`` and ``nn.NLLLoss`` with
      class-index targets divide the summed weighted losses by the summed class weights
      (``ignore_index`` weighs nothing); other criteria, and ``"batchmean"``, weigh each
      replica's value by its sample count (of the first target tensor, else the output). An
      empty batch gives NaN, as the criterion does;
    * ``"sum"``: the sum;
    * ``"none"``: the per-sample losses concatenated along :attr:`dim`.

    Args:
        criterion (callable): the loss, e.g. ``nn.CrossEntropyLoss()``.
        output_device (int, str or torch.device, optional): where the combined loss goes.
            Default: the first output's device.
        dim (int): the dimension the batch was split along. Default: ``0``.
        reduction (str, keyword-only, optional): ``"mean"``, ``"batchmean"``, ``"sum"`` or
            ``"none"``. Default: the criterion's ``reduction`` attribute, else ``"mean"``.
        check_targets (bool, keyword-only, optional): refuse target chunks whose size along
            :attr:`dim` differs from their output's. Turn it off for outputs whose batch
            dimension is flattened (``logits.view(-1, vocab)``). Default: ``True``.

    Example::

        >>> model = torchdp.DataParallel(lm, gather_output=False)
        >>> criterion = torchdp.DataParallelCriterion(nn.CrossEntropyLoss())
        >>> loss = criterion(model(tokens), targets)   # logits never leave their GPU
        >>> loss.backward()
    """

    def __init__(
        self,
        criterion: Callable[..., Any],
        output_device: DeviceLike | None = None,
        dim: int = 0,
        *,
        reduction: str | None = None,
        check_targets: bool = True,
    ) -> None:
        """Wraps :attr:`criterion`; the arguments are described in the class docstring."""
        super().__init__()
        if not callable(criterion):
            raise TypeError(
                f"{_API}: criterion must be callable (e.g. nn.CrossEntropyLoss()), got "
                f"{type(criterion).__qualname__}"
            )
        if reduction is None:
            reduction = getattr(criterion, "reduction", "mean")
        # The names of torchdp::LossReduction, shared with parallel_loss ("batchmean", as
        # nn.KLDivLoss's: each replica's sum over its chunk's batch size, combined like "mean").
        reduction = _C.loss_reduction(reduction, _API)
        self.criterion = criterion
        self.output_device = None if output_device is None else _to_device(output_device, _API)
        if self.output_device is not None:
            _C.normalize_devices([self.output_device], f"{_API} (output_device)")
        self.dim = _check_dim(dim, _API)
        self.reduction = reduction
        self.check_targets = bool(check_targets)

    def _criteria(self, devices: list[torch.device]) -> list[Callable[..., Any]]:
        """The criterion for each device: replicated when it holds tensors (class weights...)."""
        crit = self.criterion
        if not isinstance(crit, nn.Module):
            return [crit] * len(devices)
        held = [*crit.parameters(), *crit.buffers()]
        if not held or all(d == devices[0] for d in devices):
            return [crit] * len(devices)
        misplaced = [t.device for t in held if t.device != devices[0]]
        if misplaced:
            raise RuntimeError(
                f"{_API}: the criterion's parameters and buffers must be on the first output's "
                f"device {devices[0]}, but one is on {misplaced[0]}; move it there first "
                f"(criterion.to({str(devices[0])!r}))"
            )
        return list(replicate(crit, devices, not torch.is_grad_enabled()))

    def forward(self, outputs: Sequence[Any], *targets: Any, **kwargs: Any) -> torch.Tensor:
        r"""Computes each replica's loss on its device and combines them on one device.

        Args:
            outputs (list): the per-replica outputs of
                ``torchdp.DataParallel(..., gather_output=False)``, output ``i`` on its device.
            *targets: the whole batch's targets (for example the class indices), split along
                :attr:`dim` like the DataParallel's inputs; Python numbers and other objects go
                to every replica as they are.
            **kwargs: keyword arguments of the criterion, split like the targets.

        Returns:
            Tensor: on :attr:`output_device` (default: the first output's device), the loss of
            the whole batch under :attr:`reduction`: a scalar for ``"mean"``,
            ``"batchmean"`` and ``"sum"``, the per-sample losses concatenated along :attr:`dim`
            for ``"none"``.

        Raises:
            TypeError: :attr:`outputs` is not a list or tuple of per-replica outputs.
            ValueError: the targets do not split into one chunk per output, or (with
                ``check_targets``) a chunk's size differs from its output's.
        """
        if not isinstance(outputs, (list, tuple)):
            raise TypeError(
                f"{_API}: expected the list of per-replica outputs that "
                "torchdp.DataParallel(..., gather_output=False) returns, got "
                f"{type(outputs).__qualname__}; pass gather_output=False to the DataParallel, or "
                "call the criterion itself on a gathered output"
            )
        if len(outputs) == 0:
            raise ValueError(f"{_API}: got no outputs (an empty list)")
        devices: list[torch.device] = []
        rows: list[int] = []
        for i, out in enumerate(outputs):
            t = get_a_var(out)
            if t is None:
                raise TypeError(
                    f"{_API}: output {i} holds no tensor ({type(out).__qualname__}); each "
                    "replica's output must contain a tensor on its device"
                )
            devices.append(t.device)
            rows.append(t.shape[self.dim] if -t.dim() <= self.dim < t.dim() else -1)
        n = len(outputs)
        # Outputs of uneven shares (Note [Uneven shares]): the targets split by their rows.
        by_rows = min(rows) >= 0 and [c.shape[0] for c in torch.empty(sum(rows)).chunk(n)] != rows
        if targets or kwargs:
            named = [(f"target {i}", t) for i, t in enumerate(targets)]
            named += [(f"keyword target {k!r}", t) for k, t in kwargs.items()]
            for name, t in named:
                if isinstance(t, torch.Tensor) and t.dim() == 0:
                    raise ValueError(
                        f"{_API}: {name} is a 0-dim tensor, which cannot be split among the "
                        "replicas; pass a Python number (given to every replica as it is) or a "
                        f"tensor with one entry per sample along dim {self.dim}"
                    )
            split_targets, split_kwargs = scatter_kwargs(
                targets, kwargs, devices, self.dim, shares=rows if by_rows else None
            )
            if len(split_targets) != n:
                sizes = ", ".join(
                    f"{name}: {t.shape[self.dim]}"
                    for name, t in named
                    if isinstance(t, torch.Tensor) and t.dim() > self.dim
                )
                raise ValueError(
                    f"{_API}: the targets split into {len(split_targets)} chunks along dim "
                    f"{self.dim} (sizes along it: {sizes or '?'}), but there are {n} "
                    "outputs; pass targets with the same batch size as the inputs"
                )
            if self.check_targets:
                _check_target_sizes(outputs, split_targets, split_kwargs, self.dim)
        else:
            split_targets, split_kwargs = ((),) * n, ({},) * n
        criteria = self._criteria(devices)
        destination = self.output_device if self.output_device is not None else devices[0]
        weighted = self.reduction == "mean" and all(
            _weighted_mean_applies(crit, out, tgt, kw)
            for crit, out, tgt, kw in zip(
                criteria, outputs, split_targets, split_kwargs, strict=True
            )
        )
        losses = []
        compute = _weighted_sum if weighted else (lambda c, o, t, k: c(o, *t, **k))
        for crit, out, tgt, kw, device in zip(
            criteria, outputs, split_targets, split_kwargs, devices, strict=True
        ):
            with record_function("DataParallelCriterion.replica"):
                if device.type == "cuda":
                    with torch.cuda.device(device):
                        losses.append(compute(crit, out, tgt, kw))
                else:
                    losses.append(compute(crit, out, tgt, kw))
        if weighted:
            total = torch.stack([loss.to(destination) for loss, _ in losses]).sum()
            weight = torch.stack([w.to(destination) for _, w in losses]).sum()
            return total / weight
        if self.reduction == "none":
            return gather(losses, destination, dim=self.dim)
        for i, loss in enumerate(losses):
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss)
                raise ValueError(
                    f"{_API}: with reduction={self.reduction!r} the criterion must return a "
                    f"scalar tensor per replica, but replica {i} gave {shape}; use "
                    "reduction='none' for per-sample losses"
                )
        moved = [loss.to(destination) for loss in losses]
        if self.reduction == "sum":
            return torch.stack(moved).sum()
        counts = [
            _batch_size(tgt, kw, out, self.dim)
            for tgt, kw, out in zip(split_targets, split_kwargs, outputs, strict=True)
        ]
        total = float(sum(counts))
        # Python-scalar weights: no host-to-device copy, which would wait for the GPU every step.
        # An empty batch: every replica's loss is the criterion's value for no samples (NaN).
        weights = [c / total for c in counts] if total else [1.0 / n] * n
        return torch.stack([loss * w for loss, w in zip(moved, weights, strict=True)]).sum()


def _check_target_sizes(
    outputs: Sequence[Any],
    split_targets: Sequence[tuple[Any, ...]],
    split_kwargs: Sequence[dict[str, Any]],
    dim: int,
) -> None:
    """Refuses target chunks whose size along ``dim`` differs from their output's (misaligned)."""
    for i, (out, tgt, kw) in enumerate(zip(outputs, split_targets, split_kwargs, strict=True)):
        o = get_a_var(out)
        if o is None or o.dim() <= dim:
            continue
        for t in (*tgt, *kw.values()):
            if isinstance(t, torch.Tensor) and t.dim() > dim and t.shape[dim] != o.shape[dim]:
                out_sizes = [_size_along(x, dim) for x in outputs]
                raise ValueError(
                    f"{_API}: replica {i}'s target chunk has {t.shape[dim]} samples along dim "
                    f"{dim} but its output has {o.shape[dim]} (outputs per replica: {out_sizes}, "
                    f"{sum(s for s in out_sizes if s is not None)} in all); pass targets with the "
                    "batch size of the DataParallel forward's inputs, or, when the outputs' batch "
                    "dimension is flattened with another one (logits.view(-1, vocab)), "
                    "check_targets=False"
                )


def _size_along(output: Any, dim: int) -> int | None:
    t = get_a_var(output)
    return None if t is None or t.dim() <= dim else int(t.shape[dim])


def _weighted_mean_applies(crit: Any, output: Any, targets: tuple[Any, ...], kwargs: Any) -> bool:
    """CrossEntropyLoss/NLLLoss with class-index targets: their "mean" divides by the total class
    weight, not the sample count, so chunk-size weighting would be wrong (NaN if all ignored)."""
    if type(crit) not in (nn.CrossEntropyLoss, nn.NLLLoss) or crit.reduction != "mean":
        return False
    if kwargs or len(targets) != 1 or not isinstance(output, torch.Tensor):
        return False
    t = targets[0]
    return isinstance(t, torch.Tensor) and not (t.is_floating_point() or t.is_complex())


def _weighted_sum(
    crit: Any, output: torch.Tensor, targets: tuple[Any, ...], kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of one replica's weighted losses, sum of their weights) for _weighted_mean_applies."""
    (t,) = targets
    if type(crit) is nn.CrossEntropyLoss:
        total = F.cross_entropy(
            output,
            t,
            weight=crit.weight,
            ignore_index=crit.ignore_index,
            reduction="sum",
            label_smoothing=crit.label_smoothing,
        )
    else:
        total = F.nll_loss(
            output, t, weight=crit.weight, ignore_index=crit.ignore_index, reduction="sum"
        )
    valid = t != crit.ignore_index
    weights = valid if crit.weight is None else crit.weight[torch.where(valid, t, 0)] * valid
    return total, weights.sum().to(total.dtype)


def _batch_size(targets: tuple[Any, ...], kwargs: dict[str, Any], output: Any, dim: int) -> int:
    """A chunk's sample count: of its first target tensor (positional, then keyword) or output."""
    t = get_a_var(targets) if targets else None
    if t is None and kwargs:
        t = get_a_var(kwargs)
    if t is None:
        t = get_a_var(output)
    assert t is not None
    return int(t.shape[dim]) if t.dim() > 0 else 1
