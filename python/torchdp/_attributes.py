"""The stale-attribute check (``stale_attributes=``): replicate copies only registered tensors, so
a replica's plain tensor attributes and lists of submodules still hold the original's."""

from __future__ import annotations

import copy
import dataclasses
import threading
import warnings
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from torchdp._tree import is_namedtuple

__all__ = [
    "STALE_ATTRIBUTE_POLICIES",
    "check_stale_attribute_policy",
    "fix_stale_attributes",
    "map_state",
    "module_paths",
    "plain_attributes",
]

STALE_ATTRIBUTE_POLICIES = ("move", "warn", "error")

_INTERNAL_KEYS = frozenset(nn.Module().__dict__) | {"_former_parameters", "_is_replica"}

_MAX_DEPTH = 4
_STATE_TYPES = (torch.Tensor, nn.Module, list, tuple, dict, deque)  # what map_state looks into

_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def module_paths(network: nn.Module) -> dict[int, str]:
    """Qualified names in network.named_modules() order; the first name of a shared module wins."""
    return {id(m): name for name, m in network.named_modules()}


def plain_attributes(module: nn.Module) -> list[str]:
    """The keys of ``module.__dict__`` that are user state (not nn.Module's or replicate's) and
    may hold tensors or modules."""
    return [
        k
        for k, v in module.__dict__.items()
        if k not in _INTERNAL_KEYS and isinstance(v, _STATE_TYPES)
    ]


def check_stale_attribute_policy(policy: Any, api: str) -> str | None:
    """``policy`` if it is a valid ``stale_attributes=`` value, else a ``ValueError``."""
    if policy is None or (isinstance(policy, str) and policy in STALE_ATTRIBUTE_POLICIES):
        return policy
    raise ValueError(
        f"{api}: stale_attributes must be None (leave replicas as PyTorch does), 'move', 'warn' "
        f"or 'error', got {policy!r}"
    )


@dataclasses.dataclass
class _Replica:
    """Resolves the network's modules and registered tensors to one replica's copies."""

    replica_modules: list[nn.Module]
    module_index: dict[int, int]
    tensor_index: dict[int, tuple[int, str]]
    device: torch.device
    source: torch.device
    found: list[str] = dataclasses.field(default_factory=list)  # what is stale, for the message

    def fix(self, value: Any, where: str) -> Any:
        """The map_state leaf: this replica's own copy of a stale tensor or module."""
        if isinstance(value, torch.Tensor):
            if value.device != self.source:
                return value
            self.found.append(f"{where} is a tensor on {self.source}")
            registered = self.tensor_index.get(id(value))
            if registered is not None:
                position, name = registered
                return getattr(self.replica_modules[position], name)
            return value.to(self.device)
        position = self.module_index.get(id(value))
        if position is None:  # not part of the network: not replicate's business
            return value
        self.found.append(f"{where} is the original module (type {type(value).__qualname__})")
        return self.replica_modules[position]


def map_state(value: Any, leaf: Any, where: str, depth: int = 0) -> Any:
    """``value`` with ``leaf(x, where)`` applied to its tensors and modules, also in lists, tuples,
    dicts and deques up to _MAX_DEPTH deep; containers are rebuilt, typed alike, only if changed.

    A walk of a module's own state, not of inputs or outputs, so not the tree's (Note [The Python
    tree]): modules are leaves too, the depth is bounded (state may hold anything, cycles
    included), and an unchanged container must stay the very object the replica shares."""
    if isinstance(value, (torch.Tensor, nn.Module)):
        return leaf(value, where)
    if depth >= _MAX_DEPTH:
        return value
    cls = type(value)
    if cls is list or cls is tuple or is_namedtuple(value) or isinstance(value, deque):
        items = [map_state(v, leaf, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        if cls is list:
            return items
        if cls is tuple:
            return tuple(items)
        if isinstance(value, deque):
            return cls(items, maxlen=value.maxlen)
        return cls(*items)
    if isinstance(value, dict):
        pairs = [(k, map_state(v, leaf, f"{where}[{k!r}]", depth + 1)) for k, v in value.items()]
        if all(new is value[k] for k, new in pairs):
            return value
        fixed = copy.copy(value)  # the same class, default_factory and attributes
        fixed.update(pairs)
        return fixed
    return value


def _message(
    api: str, policy: str, cls: str, path: str, key: str, j: int, replica: _Replica
) -> str:
    what = "; ".join(replica.found[:3]) + (
        f" (and {len(replica.found) - 3} more)" if len(replica.found) > 3 else ""
    )
    owner = f"module '{path}'" if path else "the root module"
    if policy == "error":
        lead = (
            f"{api}: attribute '{key}' of {owner} (type {cls}) in replica {j} on {replica.device}"
        )
    else:
        lead = f"{api}: attribute '{key}' of {cls} replicas on other devices than {replica.source}"
    return (
        f"{lead} still refers to the source device's state: {what}. replicate copies only "
        "registered parameters and buffers, so the replica would use the original's. Fix: "
        "register tensors as buffers (register_buffer(name, tensor, persistent=False) if they "
        "must stay out of the state_dict) and modules as submodules (nn.ModuleList), copy them "
        "in a post-replicate hook (torchdp.register_post_replicate_hook), or pass "
        "stale_attributes='move' to have torchdp give each replica its own copies."
    )


def fix_stale_attributes(
    modules: list[nn.Module],
    copies: list[list[nn.Module]],
    devices: Sequence[torch.device],
    policy: str,
    api: str,
    network: nn.Module,
) -> None:
    """Applies ``policy`` where replicas off ``devices[0]`` hold its tensors or the network's
    modules in plain attributes (``copies[j][p]`` copies ``modules[p]``): 'move' gives them their
    own copies (containers rebuilt, never the original's), 'warn' warns once per class and key."""
    source = devices[0]
    targets = [j for j, d in enumerate(devices) if d != source]
    if not targets:
        return
    candidates = [(p, keys) for p, m in enumerate(modules) if (keys := plain_attributes(m))]
    if not candidates:
        return
    module_index = {id(m): p for p, m in enumerate(modules)}
    tensor_index: dict[int, tuple[int, str]] = {}
    for p, m in enumerate(modules):
        for table in (m._parameters, m._buffers):
            for name, t in table.items():
                if t is not None:
                    tensor_index.setdefault(id(t), (p, name))
    for j in targets:
        replica = _Replica(copies[j], module_index, tensor_index, devices[j], source)
        for p, keys in candidates:
            state = copies[j][p].__dict__
            for key in keys:
                if key not in state:  # a hook removed it
                    continue
                replica.found = []
                fixed = map_state(state[key], replica.fix, key)
                if not replica.found:
                    continue
                if policy == "move":
                    state[key] = fixed
                    continue
                cls = type(modules[p]).__qualname__
                if policy == "error":
                    path = module_paths(network).get(id(modules[p]), "")
                    raise RuntimeError(_message(api, policy, cls, path, key, j, replica))
                with _warned_lock:
                    if (cls, key) in _warned:
                        continue
                    _warned.add((cls, key))
                warnings.warn(_message(api, policy, cls, "", key, j, replica), stacklevel=4)
