"""The nested-structure cases both languages are tested from (test_tree.py): Python's tree
(python/torchdp/_tree.py) and, for the values torch's type inference turns into IValues, the C++
engine (csrc/torchdp/structure.h, reached through tests/python/torchdp_testing.cpp).

Every case scatters a batch of 6 rows (5 or 2 where named) over ``DEVICES`` CPU devices."""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict, defaultdict, deque, namedtuple
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree

DEVICES = 3

Point = namedtuple("Point", ["x", "y"])
Empty = namedtuple("Empty", [])


class Labelled(NamedTuple):
    x: torch.Tensor
    label: str


class Mapping(dict):
    """A dict subclass that keeps nothing else."""


class Mirrored(OrderedDict):
    """As Hugging Face's ModelOutput: every key is also an attribute."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for key, value in self.items():
            object.__setattr__(self, key, value)

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, value)
        object.__setattr__(self, key, value)


@dataclasses.dataclass
class Registered:
    x: torch.Tensor
    tag: str


_pytree.register_dataclass(Registered)


@dataclasses.dataclass
class Unregistered:
    x: torch.Tensor


class _LayerBase:
    """Stands for transformers.cache_utils.CacheLayerMixin: matched by name, not imported."""


_LayerBase.__module__, _LayerBase.__qualname__ = "transformers.cache_utils", "CacheLayerMixin"


class Layer(_LayerBase):
    def __init__(self, rows: int) -> None:
        self.keys = torch.arange(rows * 4.0).reshape(rows, 4)
        self.seen = 4
        self.window = torch.tensor(2)


def rows(n: int = 6, *shape: int) -> torch.Tensor:
    return torch.arange(float(n * max(1, torch.Size(shape).numel()))).reshape(n, *shape)


@dataclasses.dataclass(frozen=True)
class Case:
    """One structure: how many leaves Python's tree finds in it and how many are tensors, how
    many replicas scatter gives; whether the C++ engine takes it (and gives as many replicas)
    and whether gather(scatter(value)) gives it back."""

    name: str
    make: Callable[[], Any]
    leaves: int
    tensors: int
    replicas: int = DEVICES
    cpp: bool = False
    round_trip: bool = True


CASES = [
    Case("tensor", rows, 1, 1, cpp=True),
    Case("tuple", lambda: (rows(), rows(6, 2)), 2, 2, cpp=True),
    Case("list", lambda: [rows(), rows()], 2, 2, cpp=True),
    Case("dict", lambda: {"a": rows(), "b": rows(6, 3)}, 2, 2, cpp=True),
    Case("nested", lambda: (rows(), {"a": [rows(), rows()]}, None), 4, 3, cpp=True),
    Case("constants", lambda: (rows(), 3, "tag", 2.5, True), 5, 1, cpp=True),
    Case("uneven batch", lambda: (rows(5), rows(5, 2)), 2, 2, cpp=True),
    Case("short tensor", lambda: (rows(), rows(2)), 2, 2, replicas=2, cpp=True, round_trip=False),
    Case("no tensor", lambda: (1, "a"), 2, 0, cpp=True),
    Case("empty containers", lambda: (rows(), (), {}), 3, 1),
    Case("named tuple", lambda: Point(rows(), rows()), 2, 2),
    Case("typed named tuple", lambda: Labelled(rows(), "l"), 2, 1),
    Case("empty named tuple", lambda: (rows(), Empty()), 1, 1),
    Case("dict subclass", lambda: Mapping(a=rows()), 1, 1),
    Case("ordered dict", lambda: OrderedDict(a=rows(), b=1), 2, 1),
    Case("defaultdict", lambda: defaultdict(list, a=rows()), 1, 1),
    Case("counter", lambda: Counter(a=rows()), 1, 1),
    Case("attribute mirror", lambda: Mirrored(logits=rows(), loss=None), 2, 1),
    Case("registered dataclass", lambda: Registered(rows(), "t"), 2, 1),
    Case("deque", lambda: (deque([rows(), 1]),), 2, 1),
    Case("unregistered dataclass", lambda: (Unregistered(rows()),), 1, 0, round_trip=False),
    Case("object split by attributes", lambda: (Layer(6),), 1, 1),
    Case("set", lambda: (rows(), {1, 2}), 2, 1, round_trip=False),
]
