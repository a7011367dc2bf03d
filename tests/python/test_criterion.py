"""Per-replica outputs (``DataParallel(..., gather_output=False)``) and per-replica losses
(``torchdp.DataParallelCriterion``): the same loss and gradients as the plain module with the
criterion on the whole batch, with only scalars travelling between devices."""

from __future__ import annotations

import pytest
import torch
from dp_testing import clone_module, cpu_devices
from torch import nn

import torchdp


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5))


def assert_same_grads(net: nn.Module, ref: nn.Module) -> None:
    for (name, p), q in zip(net.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_gather_output_false_returns_one_output_per_replica(n):
    net = _net()
    dp = torchdp.DataParallel(net, devices=cpu_devices(n), gather_output=False)
    x = torch.randn(7, 6)
    outs = dp(x)
    assert isinstance(outs, list) and len(outs) == min(n, 7)
    sizes = [t.shape[0] for t in x.chunk(n)]
    assert [o.shape[0] for o in outs] == sizes
    torch.testing.assert_close(torch.cat(outs), net(x))


def test_gather_output_false_without_devices_is_a_one_element_list():
    net = _net()
    dp = torchdp.DataParallel(net, gather_output=False)
    if dp.device_ids:  # an accelerator is visible: covered by the GPU tests
        pytest.skip("passthrough only without an accelerator")
    x = torch.randn(3, 6)
    (out,) = dp(x)
    torch.testing.assert_close(out, net(x))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("n", [2, 3])
def test_criterion_matches_the_whole_batch_loss(reduction, n):
    net = _net()
    ref = clone_module(net)
    dp = torchdp.DataParallel(net, devices=cpu_devices(n), gather_output=False)
    crit = torchdp.DataParallelCriterion(nn.CrossEntropyLoss(reduction=reduction))
    assert crit.reduction == reduction
    x, y = torch.randn(7, 6), torch.randint(0, 5, (7,))  # uneven chunks: 3, 3, 1 on 3 devices
    loss = crit(dp(x), y)
    expected = nn.CrossEntropyLoss(reduction=reduction)(ref(x), y)
    torch.testing.assert_close(loss, expected)
    loss.sum().backward()
    expected.sum().backward()
    assert_same_grads(net, ref)


def test_criterion_with_keyword_targets_dim1_and_a_function():
    net = nn.Linear(4, 3)
    ref = clone_module(net)

    class Transposed(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (features, batch) -> (3, batch)
            return self.inner(x.t()).t()

    dp = torchdp.DataParallel(Transposed(net), devices=cpu_devices(2), dim=1, gather_output=False)

    def mse(out: torch.Tensor, *, target: torch.Tensor) -> torch.Tensor:
        return (out - target).pow(2).mean()

    crit = torchdp.DataParallelCriterion(mse, dim=1)
    x, y = torch.randn(4, 5), torch.randn(3, 5)
    loss = crit(dp(x), target=y)
    torch.testing.assert_close(loss, (ref(x.t()).t() - y).pow(2).mean())


def test_explicit_reduction_overrides_and_output_device():
    net = _net()
    dp = torchdp.DataParallel(net, devices=cpu_devices(2), gather_output=False)
    crit = torchdp.DataParallelCriterion(
        lambda out, y: nn.functional.cross_entropy(out, y, reduction="sum"),
        output_device="cpu",
        reduction="sum",
    )
    x, y = torch.randn(4, 6), torch.randint(0, 5, (4,))
    loss = crit(dp(x), y)
    assert loss.device == torch.device("cpu")
    torch.testing.assert_close(loss, nn.functional.cross_entropy(net(x), y, reduction="sum"))


def test_criterion_errors_name_the_problem_and_the_fix():
    net = _net()
    dp = torchdp.DataParallel(net, devices=cpu_devices(2), gather_output=False)
    gathered = torchdp.DataParallel(net, devices=cpu_devices(2))
    x, y = torch.randn(4, 6), torch.randint(0, 5, (4,))
    crit = torchdp.DataParallelCriterion(nn.CrossEntropyLoss())
    with pytest.raises(TypeError, match="gather_output=False"):
        crit(gathered(x), y)
    with pytest.raises(ValueError, match="got no outputs"):
        crit([], y)
    with pytest.raises(ValueError, match="split into 1 chunks.*target 0: 1.*2 outputs"):
        crit(dp(x), y[:1])
    scaled = torchdp.DataParallelCriterion(lambda o, t, s: nn.functional.cross_entropy(o, t) * s)
    with pytest.raises(ValueError, match="target 1 is a 0-dim tensor.*pass a Python number"):
        scaled(dp(x), y, torch.tensor(2.0))
    with pytest.raises(ValueError, match="keyword target 's' is a 0-dim tensor"):
        scaled(dp(x), y, s=torch.tensor(2.0))
    torch.testing.assert_close(
        scaled(dp(x), y, 2.0), 2.0 * nn.functional.cross_entropy(gathered(x), y)
    )
    with pytest.raises(TypeError, match="output 0 holds no tensor"):
        crit(["a", "b"], y)
    with pytest.raises(ValueError, match="reduction must be one of"):
        torchdp.DataParallelCriterion(nn.CrossEntropyLoss(), reduction="avg")
    with pytest.raises(TypeError, match="criterion must be callable"):
        torchdp.DataParallelCriterion("cross_entropy")
    per_sample = torchdp.DataParallelCriterion(
        lambda o, t: nn.functional.cross_entropy(o, t, reduction="none"), reduction="mean"
    )
    with pytest.raises(ValueError, match="replica 0 gave \\(2,\\).*reduction='none'"):
        per_sample(dp(x), y)


WEIGHTED_MEANS = {
    "class weights": lambda: nn.CrossEntropyLoss(weight=torch.tensor([0.5, 2.0, 1.0, 3.0, 0.1])),
    "ignore_index": lambda: nn.CrossEntropyLoss(ignore_index=1),
    "both, label smoothing": lambda: nn.CrossEntropyLoss(
        weight=torch.tensor([0.5, 2.0, 1.0, 3.0, 0.1]), ignore_index=4, label_smoothing=0.2
    ),
    "NLLLoss": lambda: nn.NLLLoss(weight=torch.tensor([0.5, 2.0, 1.0, 3.0, 0.1]), ignore_index=0),
}


@pytest.mark.parametrize("name", list(WEIGHTED_MEANS))
@pytest.mark.parametrize("n", [2, 3])
def test_weighted_means_are_the_whole_batch_mean(name, n):
    """Class weights and ignored targets make the criterion's mean a weighted one: the result is
    still the whole batch's, also when one replica's targets are all ignored (no NaN)."""
    net = _net()
    ref = clone_module(net)
    dp = torchdp.DataParallel(net, devices=cpu_devices(n), gather_output=False)
    x = torch.randn(7, 6)
    y = torch.tensor([1, 1, 1, 2, 3, 4, 0])  # 3, 3, 1 on three replicas
    ignore = getattr(WEIGHTED_MEANS[name](), "ignore_index", -100)
    if ignore in (1, 0):
        y[:3] = ignore  # replica 0's targets (and, with n=3, all of them) ignored
    crit = WEIGHTED_MEANS[name]()
    log = name == "NLLLoss"
    outputs = [o.log_softmax(1) for o in dp(x)] if log else dp(x)
    loss = torchdp.DataParallelCriterion(crit)(outputs, y)
    expected = crit(ref(x).log_softmax(1) if log else ref(x), y)
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    expected.backward()
    assert_same_grads(net, ref)


def test_sample_counts_come_from_keyword_targets_too():
    """Chunks of 3, 3 and 1 samples weigh 3:3:1 also when the target is a keyword argument and
    the output's first tensor has no batch dimension."""

    class AuxAndLogits(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 5)

        def forward(self, x):
            logits = self.lin(x)
            return logits.mean(), logits

    def loss_fn(out, target=None):
        return nn.functional.cross_entropy(out[1], target)

    net = AuxAndLogits()
    dp = torchdp.DataParallel(net, devices=cpu_devices(3), gather_output=False)
    x, y = torch.randn(7, 6), torch.randint(0, 5, (7,))
    crit = torchdp.DataParallelCriterion(loss_fn, check_targets=False)
    expected = nn.functional.cross_entropy(net.lin(x), y)
    torch.testing.assert_close(crit(dp(x), target=y), expected)
    torch.testing.assert_close(crit(dp(x), y), expected)


def test_targets_with_another_batch_size_are_refused():
    # 3 targets for 4 samples split into as many chunks (2 and 1) as there are outputs (2 and 2):
    # without the check the chunks would be paired with the wrong samples and the mean weighted
    # 2/3 : 1/3, silently.
    dp = torchdp.DataParallel(nn.Linear(3, 1), devices=cpu_devices(2), gather_output=False)
    outputs = dp(torch.randn(4, 3))
    crit = torchdp.DataParallelCriterion(lambda o, t: (o.squeeze(1) - t).pow(2).mean())
    with pytest.raises(
        ValueError,
        match=r"replica 1's target chunk has 1 samples along dim 0 but its output has 2 "
        r"\(outputs per replica: \[2, 2\], 4 in all\)",
    ):
        crit(outputs, torch.randn(3))
    with pytest.raises(ValueError, match="replica 1's target chunk has 1 samples"):
        crit(outputs, t=torch.randn(3))
    # The same batch size passes, and equals the whole-batch loss.
    t = torch.randn(4)
    expected = (torchdp.gather(outputs, "cpu").squeeze(1) - t).pow(2).mean()
    torch.testing.assert_close(crit(outputs, t), expected)


class FlatLM(nn.Module):
    """Returns its logits with the batch dimension flattened with the sequence one."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 6)

    def forward(self, tokens):
        return self.emb(tokens).view(-1, 6)


def test_flattened_outputs_pass_with_check_targets_off():
    torch.manual_seed(0)
    net = FlatLM()
    tokens, targets = torch.randint(0, 11, (4, 5)), torch.randint(0, 6, (4, 5))
    expected = nn.functional.cross_entropy(net(tokens), targets.reshape(-1))
    dp = torchdp.DataParallel(net, devices=cpu_devices(2), gather_output=False)

    def loss(o, t):
        return nn.functional.cross_entropy(o, t.reshape(-1))

    with pytest.raises(ValueError, match=r"check_targets=False"):
        torchdp.DataParallelCriterion(loss)(dp(tokens), targets)
    crit = torchdp.DataParallelCriterion(loss, check_targets=False)
    torch.testing.assert_close(crit(dp(tokens), targets), expected)


def test_batchmean_and_empty_batches():
    torch.manual_seed(0)
    net = nn.Linear(3, 4)
    x, t = torch.randn(6, 3), torch.softmax(torch.randn(6, 4), 1)
    kl = nn.KLDivLoss(reduction="batchmean")
    expected = kl(torch.log_softmax(net(x), 1), t)
    dp = torchdp.DataParallel(net, devices=cpu_devices(2), gather_output=False)
    crit = torchdp.DataParallelCriterion(lambda o, tt: kl(torch.log_softmax(o, 1), tt))
    assert torchdp.DataParallelCriterion(kl).reduction == "batchmean"
    crit.reduction = "batchmean"
    torch.testing.assert_close(crit(dp(x), t), expected)
    # An empty batch gives the criterion's own value for no samples (NaN), not an error.
    mse = nn.MSELoss()
    empty = torchdp.DataParallelCriterion(mse)(dp(torch.randn(0, 3)), torch.randn(0, 4))
    assert torch.isnan(empty) and torch.isnan(mse(net(torch.randn(0, 3)), torch.randn(0, 4)))


def test_criterion_argument_checks():
    with pytest.raises(TypeError, match="torchdp.DataParallelCriterion: dim must be an int"):
        torchdp.DataParallelCriterion(nn.MSELoss(), dim="a")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"output_device\).*cuda:0.*no CUDA device"):
            torchdp.DataParallelCriterion(nn.MSELoss(), output_device=0)


def test_structured_outputs_and_targets():
    # Outputs as (logits, aux) tuples and the targets as a dict: the criterion sees each replica's
    # own structures.
    class TwoHeads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(4, 6)

        def forward(self, x):
            h = self.body(x)
            return h[:, :3], h[:, 3:]

    net = TwoHeads()
    dp = torchdp.DataParallel(net, devices=cpu_devices(3), gather_output=False)

    def loss(out, targets):
        logits, aux = out
        return (
            nn.functional.cross_entropy(logits, targets["label"])
            + (aux - targets["aux"]).pow(2).mean()
        )

    x = torch.randn(9, 4)
    targets = {"label": torch.randint(0, 3, (9,)), "aux": torch.randn(9, 3)}
    got = torchdp.DataParallelCriterion(loss)(dp(x), targets)
    torch.testing.assert_close(got, loss(net(x), targets))


def test_loss_reduction_names_are_the_cpp_map():
    """DataParallelCriterion and C++'s parallel_loss share one name map (torchdp::LossReduction)."""
    from torchdp import _C

    names = _C.loss_reductions()
    assert names == ["mean", "batchmean", "sum", "none"]
    for name in names:
        assert _C.loss_reduction(name, "api") == name
        assert torchdp.DataParallelCriterion(nn.MSELoss(), reduction=name).reduction == name
    message = (
        "torchdp.DataParallelCriterion: reduction must be one of 'mean', 'batchmean', 'sum', "
        "'none', got 'avg'"
    )
    with pytest.raises(ValueError) as info:
        torchdp.DataParallelCriterion(nn.MSELoss(), reduction="avg")
    assert str(info.value) == message
    with pytest.raises(ValueError, match="got 'Mean'"):
        _C.loss_reduction("Mean", "api")
    with pytest.raises(ValueError, match="reduction must be one of .*got '3'"):
        torchdp.DataParallelCriterion(nn.MSELoss(), reduction=3)
