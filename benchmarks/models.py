"""The benchmark models: one registry for every benchmark script and for targets.py.

An entry of MODELS names a model, its builder (seeded, so every process and every mode starts from
the same weights), its sizes at full scale and in ``--smoke`` runs (tiny, on the CPU), and for the
training-step models the two-GPU target that targets.py judges. A model added here is timed by
bench_train_step.py (``suite="train"``; ``suite="memory"``: its ``--memory`` run), replicated by
bench_replicate.py and profiled by profiling.py. The C++ benchmark (benchmarks/cpp) builds its own
models; CPP_TARGET_MODELS names those its targets judge.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SEED = 1234
INPUT_SEED = 4321
LR = 1e-3


@dataclass(frozen=True)
class Spec:
    """A benchmark model. ``full`` and ``smoke`` are the keyword arguments of ``build`` and the
    fields of ``desc``, with ``batch`` and ``shape`` (one sample's input shape). ``classes`` or
    ``vocab`` make the loss a cross-entropy on random labels; without them it is
    ``out.pow(2).mean()``."""

    desc: str
    build: Callable[..., nn.Module]
    full: dict[str, Any]
    smoke: dict[str, Any]
    suite: str = "train"
    target: float | None = None  # fp32 speedup over one GPU that two GPUs must reach
    vs_ddp: bool = False  # ... and at least DDP's speedup in the same run
    label: str = ""  # the model's name in the targets table

    def sizes(self, smoke: bool) -> dict[str, Any]:
        return self.smoke if smoke else self.full


def resnet(depth: int, classes: int, **_: Any) -> nn.Module:
    try:
        import torchvision
    except ImportError:
        if depth == 50:
            raise
        # Smoke runs without torchvision (CI): a small conv net with BatchNorm in its place.
        layers = [nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()]
        return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, classes))
    return getattr(torchvision.models, f"resnet{depth}")(num_classes=classes)


def transformer(layers: int, d: int, heads: int, ff: int, **_: Any) -> nn.Module:
    layer = nn.TransformerEncoderLayer(d, heads, ff, batch_first=True)
    # enable_nested_tensor=False: the nested-tensor fast path is for inference only and warns.
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def mlp(layers: int, width: int, **_: Any) -> nn.Module:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks)


class LanguageModel(nn.Module):
    """Embedding, TransformerEncoder and a Linear head over the whole vocabulary."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, ff: int, **_: Any) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.encoder = transformer(layers, d, heads, ff)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


MODELS: dict[str, Spec] = {
    "resnet50": Spec(
        "torchvision resnet{depth}",
        resnet,
        {"depth": 50, "classes": 1000, "batch": 256, "shape": (3, 224, 224)},
        {"depth": 18, "classes": 10, "batch": 4, "shape": (3, 32, 32)},
        target=1.85,
        vs_ddp=True,
        label="ResNet-50 fp32",
    ),
    "transformer": Spec(
        "TransformerEncoder {layers}L d{d} h{heads} ff{ff}",
        transformer,
        {"layers": 12, "d": 768, "heads": 12, "ff": 3072, "batch": 64, "shape": (128, 768)},
        {"layers": 2, "d": 32, "heads": 4, "ff": 64, "batch": 4, "shape": (8, 32)},
        target=1.80,
        vs_ddp=True,
        label="TransformerEncoder fp32",
    ),
    "mlp200": Spec(
        "{layers} x (Linear({width},{width}), ReLU)",
        mlp,
        {"layers": 200, "width": 256, "batch": 512, "shape": (256,)},
        {"layers": 4, "width": 16, "batch": 8, "shape": (16,)},
        target=1.0,
        label="200-layer MLP fp32",
    ),
    "lm50k": Spec(
        "Embedding({vocab},{d}) + TransformerEncoder {layers}L d{d} h{heads} ff{ff} + "
        "Linear({d},{vocab}), cross-entropy",
        LanguageModel,
        {"vocab": 50000, "d": 1024, "layers": 4, "heads": 16, "ff": 4096, "batch": 32,
         "shape": (512,)},
        {"vocab": 1000, "d": 32, "layers": 1, "heads": 4, "ff": 64, "batch": 4, "shape": (16,)},
        suite="memory",
    ),
}  # fmt: skip

TRAIN_MODELS = tuple(n for n, s in MODELS.items() if s.suite == "train")
MEMORY_MODEL = "lm50k"
# The C++ benchmark's models (benchmarks/cpp/bench_cpp.cpp) that its targets judge.
CPP_TARGET_MODELS = ("cpp_mlp200", "cpp_convnet")


def describe(name: str, smoke: bool) -> str:
    spec = MODELS[name]
    return spec.desc.format(**spec.sizes(smoke)) + (" (smoke)" if smoke else "")


def build(name: str, smoke: bool) -> nn.Module:
    """The model on the CPU, built with the fixed seed."""
    torch.manual_seed(SEED)
    return MODELS[name].build(**MODELS[name].sizes(smoke))


def inputs(name: str, smoke: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The full batch and its labels (None without), on the CPU, from a fixed seed."""
    s = MODELS[name].sizes(smoke)
    g = torch.Generator().manual_seed(INPUT_SEED)
    shape = (s["batch"], *s["shape"])
    if "vocab" in s:
        tokens = torch.randint(0, s["vocab"], shape, generator=g)
        return tokens, torch.randint(0, s["vocab"], shape, generator=g)
    x = torch.randn(shape, generator=g)
    return x, torch.randint(0, s["classes"], shape[:1], generator=g) if "classes" in s else None


def loss(out: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    """Cross-entropy on the labels (per token for a language model), else ``out.pow(2).mean()``."""
    if target is None:
        return out.pow(2).mean()
    return F.cross_entropy(out.flatten(0, -2), target.flatten())


def without_dropout(model: nn.Module) -> nn.Module:
    """Dropout off, BatchNorm still in training mode: every step does the same computation."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        if isinstance(m, nn.MultiheadAttention):
            m.dropout = 0.0
    return model


def seq(k: int) -> nn.Module:
    """The replicate curve's network: ``nn.Sequential`` of k ``Linear(16, 16)``."""
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(k)])
