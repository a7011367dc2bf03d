"""Real models and containers from the ecosystem through torchdp.DataParallel, compared with the
plain model on one device: Hugging Face ``transformers`` (tiny GPT-2 and BERT, configs built here,
nothing downloaded), ``torchvision`` (a classification net, a segmentation model returning a
dict), and the batch containers users pass (a pytree dataclass, a deque, an attribute dict).

The packages come with ``pip install .[test]``; a test skips only when its package is absent.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import importlib.util
import warnings

import pytest
import torch
from dp_testing import cpu_devices
from torch import nn
from torch.utils import _pytree

import torchdp

N = 3  # replicas
DEVICES = [
    pytest.param(cpu_devices(N), id="cpu3"),
    pytest.param([torch.device("cuda", 0)] * 2, id="cuda0x2", marks=pytest.mark.needs_cuda),
]


def _package(name: str):
    """The package, or a skip when it is not installed (a broken install fails the test)."""
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"{name} is not installed (pip install .[test] brings it)")
    return __import__(name)


def _on(devices):
    return devices[0]


def _wrap(model, devices):
    return torchdp.DataParallel(model, devices=devices)


def _train(model, step, steps=3, lr=0.05):
    """``steps`` SGD steps of ``step(model) -> loss``; the losses."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = step(model)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


def _assert_params_close(a: nn.Module, b: nn.Module, **tol) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name, **tol)


def _scalar_gather(fn):
    """Runs ``fn`` with gather's warning about 0-dim outputs (one loss per replica) silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Was asked to gather along dimension 0")
        return fn()


TOL = {"rtol": 1e-4, "atol": 1e-5}

# ---------------------------------------------------------------------------------------------
# transformers
# ---------------------------------------------------------------------------------------------


def _gpt2():
    transformers = _package("transformers")
    config = transformers.GPT2Config(
        vocab_size=50,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def _bert():
    transformers = _package("transformers")
    config = transformers.BertConfig(
        vocab_size=50,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=3,
    )
    return transformers.BertForSequenceClassification(config)


@pytest.mark.parametrize("devices", DEVICES)
def test_gpt2_outputs_agree_by_attribute_and_by_item(devices, exact_cuda_math):
    model = _gpt2().to(_on(devices))
    ids = torch.randint(0, 50, (6, 5), device=_on(devices))
    ref = model(input_ids=ids, labels=ids)
    out = _scalar_gather(lambda: _wrap(model, devices)(input_ids=ids, labels=ids))
    n = len(devices)
    assert type(out) is type(ref)
    assert out.logits.shape == out["logits"].shape == (6, 5, 50)
    assert out.logits is out["logits"] and out.loss is out["loss"] and out[0] is out.loss
    assert out.loss.shape == (n,)  # one loss per replica, as with torch.nn.DataParallel
    assert list(out.keys()) == list(ref.keys())
    torch.testing.assert_close(out.logits, ref.logits, **TOL)
    torch.testing.assert_close(out.loss.mean(), ref.loss, **TOL)  # equal chunks, equal tokens


@pytest.mark.parametrize("devices", DEVICES)
def test_gpt2_language_model_trains_as_on_one_device(devices, exact_cuda_math):
    model = _gpt2().to(_on(devices))
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 50, (6, 5), device=_on(devices))
    dp = _wrap(model, devices)
    got = _scalar_gather(lambda: _train(dp, lambda m: m(input_ids=ids, labels=ids).loss.mean()))
    want = _train(ref, lambda m: m(input_ids=ids, labels=ids).loss)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), **TOL)
    _assert_params_close(model, ref, **TOL)


@pytest.mark.parametrize("devices", DEVICES)
def test_bert_classifier_trains_as_on_one_device(devices, exact_cuda_math):
    model = _bert().to(_on(devices))
    ref = copy.deepcopy(model)
    dev = _on(devices)
    ids = torch.randint(0, 50, (6, 7), device=dev)
    mask = torch.ones_like(ids)
    labels = torch.tensor([0, 1, 2, 2, 1, 0], device=dev)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    dp = _wrap(model, devices)

    out = _scalar_gather(lambda: dp(**batch))
    plain = ref(**batch)
    assert out.logits is out["logits"] and out.logits.shape == (6, 3)
    torch.testing.assert_close(out.logits, plain.logits, **TOL)
    # The per-replica losses: each the mean over its own two rows.
    size = -(-6 // len(devices))
    chunks = [ref(**{k: v[i : i + size] for k, v in batch.items()}).loss for i in range(0, 6, size)]
    torch.testing.assert_close(out.loss, torch.stack(chunks), **TOL)

    got = _scalar_gather(lambda: _train(dp, lambda m: m(**batch).loss.mean()))
    want = _train(ref, lambda m: m(**batch).loss)
    torch.testing.assert_close(torch.stack(got), torch.stack(want), **TOL)
    _assert_params_close(model, ref, **TOL)


def test_model_output_as_an_input_is_split_with_its_attributes():
    transformers = _package("transformers")
    from transformers.modeling_outputs import BaseModelOutput

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, features):
            # Attribute and item access must see the same chunk.
            assert features.last_hidden_state is features["last_hidden_state"]
            return self.lin(features.last_hidden_state)

    assert transformers is not None
    head = Head()
    features = BaseModelOutput(last_hidden_state=torch.randn(6, 4))
    out = _wrap(head, cpu_devices(N))(features)
    assert out.shape == (6, 2)
    torch.testing.assert_close(out, head(features), **TOL)


# ---------------------------------------------------------------------------------------------
# torchvision
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def exact_cuda_math():
    """TF32 off while the test runs: convolutions and matmuls in full fp32 precision on GPUs,
    so that differences in summation order stay at fp32's rounding."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("devices", DEVICES)
def test_torchvision_classifier_matches_one_device(devices, exact_cuda_math):
    torchvision = _package("torchvision")
    dev = _on(devices)
    model = torchvision.models.resnet18(num_classes=5).to(dev)
    ref = copy.deepcopy(model)
    dp = _wrap(model, devices)
    x = torch.randn(6, 3, 32, 32, device=dev)
    y = torch.tensor([0, 1, 2, 3, 4, 0], device=dev)

    # Eval mode: the same function of each sample, so the whole batch matches.
    model.eval()
    ref.eval()
    with torch.no_grad():
        torch.testing.assert_close(dp(x), ref(x), **TOL)

    # Train mode: BatchNorm normalises each replica's chunk, so the reference runs the plain
    # model chunk by chunk; the summed loss and its gradients must agree.
    model.train()
    ref.train()
    size = -(-6 // len(devices))
    loss = nn.functional.cross_entropy(dp(x), y, reduction="sum")
    want = sum(
        nn.functional.cross_entropy(ref(x[i : i + size]), y[i : i + size], reduction="sum")
        for i in range(0, 6, size)
    )
    torch.testing.assert_close(loss, want, **TOL)
    loss.backward()
    want.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("devices", DEVICES)
def test_torchvision_segmentation_dict_output(devices, exact_cuda_math):
    torchvision = _package("torchvision")
    dev = _on(devices)
    seg = torchvision.models.segmentation.deeplabv3_mobilenet_v3_large(
        weights=None, weights_backbone=None, num_classes=3, aux_loss=True
    ).to(dev)
    seg.eval()
    x = torch.randn(6, 3, 64, 64, device=dev)
    with torch.no_grad():
        out = _wrap(seg, devices)(x)
        ref = seg(x)
    assert type(out) is type(ref) and list(out) == ["out", "aux"]
    for key in ("out", "aux"):
        assert out[key].shape == (6, 3, 64, 64)
        torch.testing.assert_close(out[key], ref[key], **TOL)

    seg.train()
    dp = _wrap(seg, devices)
    out = dp(x)
    (out["out"].mean() + 0.5 * out["aux"].mean()).backward()
    assert all(p.grad is not None for p in seg.classifier.parameters())


# ---------------------------------------------------------------------------------------------
# Batch containers
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    mask: torch.Tensor


_pytree.register_dataclass(Batch)


class Rows(nn.Module):
    """Returns each input row (so lost rows show in the output's length)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, batch):
        if isinstance(batch, Batch):
            return self.lin(batch.x) * batch.mask[:, None]
        if isinstance(batch, collections.deque):
            return self.lin(batch[0]) * batch[1][:, None]
        return self.lin(batch.x) * batch["mask"][:, None]


def _containers():
    x, mask = torch.randn(7, 3), torch.ones(7)
    return {
        "dataclass": lambda x=x, m=mask: Batch(x, m),
        "deque": lambda x=x, m=mask: collections.deque([x, m]),
    }


@pytest.mark.parametrize("kind", ["dataclass", "deque"])
def test_pytree_batches_are_split_field_by_field(kind):
    net = Rows()
    batch = _containers()[kind]()
    out = _wrap(net, cpu_devices(N))(batch)
    torch.testing.assert_close(out, net(batch), **TOL)


@pytest.mark.parametrize("kind, path", [("dataclass", ".mask"), ("deque", "[1]")])
def test_a_short_tensor_inside_a_pytree_batch_is_an_error_not_lost_rows(kind, path):
    net = Rows()
    x = torch.randn(7, 3)
    short = torch.ones(2)
    batch = Batch(x, short) if kind == "dataclass" else collections.deque([x, short])
    with pytest.raises(ValueError, match=rf"positional argument 0\{path} has 2"):
        _wrap(net, cpu_devices(N))(batch)


class AttrDict(dict):
    """An attribute dict in the style of EasyDict: items mirrored as attributes."""

    def __init__(self, d=None, **kwargs):
        super().__init__()
        for k, v in {**(d or {}), **kwargs}.items():
            setattr(self, k, v)

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        super().__setitem__(name, value)

    __setitem__ = __setattr__


def test_an_attribute_dict_input_gives_each_replica_its_chunk():
    net = Rows()
    batch = AttrDict(x=torch.randn(6, 3), mask=torch.ones(6))
    out = _wrap(net, cpu_devices(N))(batch)
    assert out.shape == (6, 3)
    torch.testing.assert_close(out, net(batch), **TOL)
    chunks = torchdp.scatter(batch, cpu_devices(N))
    assert all(type(c) is AttrDict and c.x is c["x"] and c.x.shape == (2, 3) for c in chunks)


class KeepsAttrDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        return AttrDict(y=self.lin(x), rows=x.shape[0])


def test_an_attribute_dict_output_is_gathered_with_its_attributes():
    net = KeepsAttrDict()
    x = torch.randn(6, 3)
    out = _wrap(net, cpu_devices(N))(x)
    assert type(out) is AttrDict
    assert out.y is out["y"] and out.y.shape == (6, 3)
    torch.testing.assert_close(out.y, net(x).y, **TOL)


def test_a_defaultdict_output_keeps_its_factory():
    class Net(nn.Module):
        def forward(self, x):
            d = collections.defaultdict(list)
            d["y"] = x * 2
            return d

    out = _wrap(Net(), cpu_devices(N))(torch.randn(6, 3))
    assert type(out) is collections.defaultdict and out.default_factory is list
    assert out["y"].shape == (6, 3) and out["missing"] == []
