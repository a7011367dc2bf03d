"""Methods other than forward run split over the devices (``DataParallel.parallel_method``) and
the padded gather of outputs of different sizes (``torchdp.gather(..., pad_value=...)``), each
compared with the method or ``torch.cat`` on one device. The generate tests build tiny random
transformers models (nothing is downloaded) and skip without transformers."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from dp_testing import cpu_devices
from torch import nn

import torchdp

PAD = 0


class Tagger(nn.Module):
    """A module whose method takes tensors, numbers, strings and dicts, positional and keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.register_buffer("offset", torch.tensor([0.5, -0.5]))
        self.not_a_method = 7

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)

    def mix(
        self,
        x: torch.Tensor,
        repeat: int,
        tag: str,
        options: dict,
        *,
        mask: torch.Tensor | None = None,
        scale: float = 1.0,
    ) -> dict:
        y = self.linear(x).repeat(1, repeat) * scale * options["gain"] + self.offset.repeat(repeat)
        if mask is not None:
            y = y * mask
        return {"y": y, "tag": tag, "rows": torch.tensor([x.shape[0]])}

    def grow(self, x: torch.Tensor) -> torch.Tensor:
        """Rows of as many columns as the largest value of their chunk: sizes differ by replica."""
        width = int(x.max().item())
        return self.linear(x)[:, :1].expand(-1, width) * torch.arange(1.0, width + 1)


def _dp(module: nn.Module, n: int = 2, **kwargs) -> torchdp.DataParallel:
    return torchdp.DataParallel(module, devices=cpu_devices(n), **kwargs)


# ---------------------------------------------------------------------------------------------
# Ordinary methods


@pytest.mark.parametrize("n", [2, 3])
def test_method_with_tensor_and_other_arguments_equals_one_device(n: int) -> None:
    torch.manual_seed(0)
    module = Tagger()
    x, mask = torch.randn(5, 3), torch.rand(5, 4)
    options = {"gain": 2.0}
    expected = module.mix(x, 2, "tag", options, mask=mask, scale=0.5)
    out = _dp(module, n).parallel_method("mix")(x, 2, "tag", options, mask=mask, scale=0.5)
    assert out.keys() == expected.keys()
    torch.testing.assert_close(out["y"], expected["y"])
    assert out["tag"] == "tag"
    # One row count per replica: the chunks of 5 rows over n replicas.
    assert out["rows"].tolist() == [len(c) for c in x.chunk(n)]


def test_method_gradients_equal_one_device() -> None:
    torch.manual_seed(0)
    module = Tagger()
    reference = Tagger()
    reference.load_state_dict(module.state_dict())
    x = torch.randn(6, 3, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = _dp(module, 3).parallel_method("mix")(x, 3, "t", {"gain": 1.5})
    out["y"].square().sum().backward()
    reference.mix(x_ref, 3, "t", {"gain": 1.5})["y"].square().sum().backward()
    for (name, p), p_ref in zip(module.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, p_ref.grad, msg=name)
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_forward_by_name_is_the_forward() -> None:
    torch.manual_seed(0)
    module = Tagger()
    dp = _dp(module, 2)
    x = torch.randn(4, 3)
    torch.testing.assert_close(dp.parallel_method("forward")(x), dp(x))
    torch.testing.assert_close(dp.parallel_method("forward")(x), module(x))


def test_one_device_and_passthrough_call_the_module_itself() -> None:
    seen: list[nn.Module] = []

    class Recorder(Tagger):
        def who(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(self)
            return x * 2

    module = Recorder()
    x = torch.ones(4, 1)
    torch.testing.assert_close(_dp(module, 1).parallel_method("who")(x), x * 2)
    assert seen == [module]
    seen.clear()
    _dp(module, 2).parallel_method("who")(x)
    assert len(seen) == 2
    assert all(s is not module for s in seen)
    seen.clear()
    if torch.cuda.is_available():
        return  # the passthrough below is the wrapper without an accelerator
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # device_ids ignored without an accelerator
        passthrough = torchdp.DataParallel(module, device_ids=[0, 1])
    assert passthrough.device_ids == []
    torch.testing.assert_close(passthrough.parallel_method("who")(x), x * 2)
    assert seen == [module]


def test_overridden_pipeline_methods_are_used() -> None:
    """Subclasses that override scatter, replicate, parallel_apply and gather see method calls."""
    calls: list[str] = []

    class Counting(torchdp.DataParallel):
        def scatter(self, inputs, kwargs, device_ids):
            calls.append("scatter")
            return super().scatter(inputs, kwargs, device_ids)

        def replicate(self, module, device_ids):
            calls.append("replicate")
            return super().replicate(module, device_ids)

        def parallel_apply(self, replicas, inputs, kwargs):
            calls.append("parallel_apply")
            # Callables that run the method on each replica, which they carry as .module.
            assert [type(r.module) for r in replicas] == [Tagger, Tagger]
            return super().parallel_apply(replicas, inputs, kwargs)

        def gather(self, outputs, output_device):
            calls.append("gather")
            return super().gather(outputs, output_device)

    torch.manual_seed(0)
    module = Tagger()
    dp = Counting(module, devices=cpu_devices(2))
    x = torch.tensor([[1.0, 0, 0], [3.0, 0, 0]])
    out = dp.parallel_method("grow", pad_value=-1.0)(x)
    assert calls == ["scatter", "replicate", "parallel_apply", "gather"]
    # super().gather() pads with the call's pad value: row 0 has 1 column, row 1 has 3.
    assert out.shape == (2, 3)
    assert out[0, 1:].tolist() == [-1.0, -1.0]
    torch.testing.assert_close(out[1], module.grow(x[1:])[0])


def test_replicas_list_their_parameters_only_during_a_method() -> None:
    """Note [Parameters of replicas in method calls]: listed while the method runs, then not."""
    during: list[int] = []

    class Counter(Tagger):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            during.append(len(list(self.parameters())))
            return x

        def count(self, x: torch.Tensor) -> torch.Tensor:
            during.append(len(list(self.parameters())))
            return x

    kept: list[nn.Module] = []

    class Keeping(torchdp.DataParallel):
        def parallel_apply(self, replicas, inputs, kwargs):
            kept.extend(r.module for r in replicas if not isinstance(r, nn.Module))
            return super().parallel_apply(replicas, inputs, kwargs)

    module = Counter()
    dp = Keeping(module, devices=cpu_devices(2))
    dp.parallel_method("count")(torch.ones(2, 3))
    assert during == [2, 2]  # the linear layer's weight and bias
    assert [len(list(r.parameters())) for r in kept] == [0, 0]
    during.clear()
    dp(torch.ones(2, 3))  # a forward after it, on the kept replicas: as in PyTorch
    assert during == [0, 0]


def test_gather_output_false_returns_each_replica_output() -> None:
    module = Tagger()
    x = torch.tensor([[1.0, 0, 0], [2.0, 0, 0], [4.0, 0, 0]])
    outs = _dp(module, 3, gather_output=False).parallel_method("grow")(x)
    assert [tuple(o.shape) for o in outs] == [(1, 1), (1, 2), (1, 4)]


# ---------------------------------------------------------------------------------------------
# Errors


def test_method_name_errors() -> None:
    dp = _dp(Tagger(), 2)
    api = "torchdp.DataParallel.parallel_method"
    with pytest.raises(AttributeError, match=f"{api}: .*Tagger.* no attribute 'mixx'.*'mix'"):
        dp.parallel_method("mixx")
    with pytest.raises(TypeError, match=f"{api}: Tagger.not_a_method is a int, not a method"):
        dp.parallel_method("not_a_method")
    with pytest.raises(TypeError, match=f"{api}: the method name must be a str, got int 3"):
        dp.parallel_method(3)
    with pytest.raises(TypeError, match=f"{api}: pad_value must be a number.*got str 'x'"):
        dp.parallel_method("mix", pad_value="x")


def test_missing_wrapper_attribute_names_parallel_method() -> None:
    dp = _dp(Tagger(), 2)
    with pytest.raises(
        AttributeError,
        match=r"'DataParallel' object has no attribute 'mix'; .*"
        r"Tagger\.mix runs split over the devices through "
        r"dp\.parallel_method\('mix'\)\(\.\.\.\), or on one device as "
        r"dp\.module\.mix\(\.\.\.\)",
    ):
        dp.mix(torch.ones(2, 3), 1, "t", {"gain": 1.0})
    with pytest.raises(AttributeError, match=r"^'DataParallel' object has no attribute 'nothing'$"):
        dp.nothing  # noqa: B018
    assert not hasattr(dp, "not_a_method")  # instance attributes of the module: no hint needed


def test_different_sizes_without_pad_value_name_the_option() -> None:
    dp = _dp(Tagger(), 2)
    x = torch.tensor([[1.0, 0, 0], [3.0, 0, 0]])
    with pytest.raises(
        RuntimeError, match=r"invalid shape \[1, 3\].*give a pad value \(pad_value\)"
    ):
        dp.parallel_method("grow")(x)


def test_pad_value_the_dtype_cannot_hold() -> None:
    dp = _dp(Tagger(), 2)
    x = torch.tensor([[1.0, 0, 0], [3.0, 0, 0]])

    class Ids(Tagger):
        def ids(self, x: torch.Tensor) -> torch.Tensor:
            return torch.ones(1, int(x.max().item()), dtype=torch.long)

    with pytest.raises(RuntimeError, match=r"pad value 0\.5 cannot be stored.*Long"):
        _dp(Ids(), 2).parallel_method("ids", pad_value=0.5)(x)
    assert dp.parallel_method("grow", pad_value=0.5)(x).shape == (2, 3)


def test_failed_method_leaves_the_module_as_it_was() -> None:
    class Stepper(Tagger):
        def step(self, x: torch.Tensor) -> torch.Tensor:
            self.offset.add_(1.0)  # replica 0 shares the module's storage
            if x[0, 0] < 0:
                raise ValueError("negative input")
            return self.linear(x)

    module = Stepper()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    x = torch.ones(4, 3)
    x[2:] = -1.0
    with pytest.raises(ValueError, match="negative input") as info:
        _dp(module, 2).parallel_method("step")(x)
    assert "in replica 1 on device cpu" in str(info.value)
    for k, v in module.state_dict().items():
        torch.testing.assert_close(v, before[k], msg=k)


# ---------------------------------------------------------------------------------------------
# The padded gather


def test_gather_pads_nested_outputs_and_keeps_gradients() -> None:
    a = torch.randn(2, 3, requires_grad=True)
    b = torch.randn(1, 5, requires_grad=True)
    outs = [{"ids": a, "n": 2}, {"ids": b, "n": 2}]
    out = torchdp.gather(outs, "cpu", pad_value=-1)
    assert out["n"] == 2
    assert out["ids"].shape == (3, 5)
    torch.testing.assert_close(out["ids"][:2, :3], a)
    assert (out["ids"][:2, 3:] == -1).all()
    weight = torch.randn(3, 5)
    (out["ids"] * weight).sum().backward()
    torch.testing.assert_close(a.grad, weight[:2, :3])
    torch.testing.assert_close(b.grad, weight[2:])


def test_gather_pad_value_errors() -> None:
    with pytest.raises(TypeError, match="torchdp.gather: pad_value must be a number"):
        torchdp.gather([torch.ones(1, 2), torch.ones(1, 3)], "cpu", pad_value=[0])
    # A one-element tensor is taken as its number.
    out = torchdp.gather([torch.ones(1, 2), torch.ones(1, 3)], "cpu", pad_value=torch.tensor(4))
    assert out[0].tolist() == [1.0, 1.0, 4.0]


# ---------------------------------------------------------------------------------------------
# generate() of tiny transformers models


def _causal_lm(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.manual_seed(0)
    special = {"bos_token_id": 1, "eos_token_id": None, "pad_token_id": PAD}
    if kind == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=2, **special
        )
        return transformers.GPT2LMHeadModel(config).eval()
    config = transformers.LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **special,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _early_eos(new_tokens: torch.Tensor) -> int:
    """A token that row 0 generates before its last step and the last row never does, so that
    with it as EOS replica 0 (row 0) stops early and the last replica runs to the end."""
    last = set(new_tokens[-1].tolist())
    for step, token in enumerate(new_tokens[0, :-1].tolist()):
        if token not in last and token != PAD and token not in new_tokens[0, :step].tolist():
            return token
    raise AssertionError(f"no early EOS candidate in {new_tokens.tolist()}")


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_greedy_generate_equals_one_device(kind: str) -> None:
    model = _causal_lm(kind)
    torch.manual_seed(1)
    ids = torch.randint(3, 100, (4, 5))
    settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": PAD}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' notices about generation settings
        with torch.no_grad():
            free = model.generate(ids, attention_mask=torch.ones_like(ids), **settings)
        eos = _early_eos(free[:, ids.shape[1] :])
        settings["eos_token_id"] = eos
        mask = torch.ones_like(ids)
        with torch.no_grad():
            expected = model.generate(ids, attention_mask=mask, **settings)
            dp = _dp(model, 4)
            per_replica = _dp(model, 4, gather_output=False).parallel_method("generate")(
                ids, attention_mask=mask, **settings
            )
            out = dp.parallel_method("generate", pad_value=PAD)(
                ids, attention_mask=mask, **settings
            )
    # The replicas stopped at different lengths, so the gather padded.
    lengths = [o.shape[1] for o in per_replica]
    assert lengths[0] < lengths[-1] == expected.shape[1], lengths
    assert out.shape == expected.shape
    for row in range(ids.shape[0]):
        assert out[row].tolist() == expected[row].tolist(), row
    with (
        pytest.raises(RuntimeError, match="pad_value"),
        warnings.catch_warnings(),
        torch.no_grad(),
    ):
        warnings.simplefilter("ignore")
        dp.parallel_method("generate")(ids, attention_mask=mask, **settings)


def test_generate_with_grad_mode_on_and_an_uneven_split() -> None:
    """Five rows on two replicas (3 and 2), generate called without torch.no_grad()."""
    model = _causal_lm("gpt2")
    torch.manual_seed(2)
    ids = torch.randint(3, 100, (5, 4))
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": PAD}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = model.generate(ids, attention_mask=torch.ones_like(ids), **settings)
        out = _dp(model, 2).parallel_method("generate", pad_value=PAD)(
            ids, attention_mask=torch.ones_like(ids), **settings
        )
    assert out.tolist() == expected.tolist()
