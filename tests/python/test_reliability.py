"""Reliability of what every caller shares: the persistent workers (fork, concurrent callers,
interrupts, repeated failures) and the buffer rollback of failed forwards."""

from __future__ import annotations

import _thread
import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import weakref

import pytest
import torch
from torch import nn

import torchdp

DEVICE_LISTS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("cuda:0", id="cuda0", marks=pytest.mark.needs_cuda),
]


def _devices(kind: str, n: int) -> list[torch.device]:
    return [torch.device(kind)] * n


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _python(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """A fresh interpreter that imports this torchdp (the test's sys.path)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return subprocess.run(
        [sys.executable, *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc")
needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _small_net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


# ---------------------------------------------------------------------------------------------
# Fork
# ---------------------------------------------------------------------------------------------


def _wait_or_kill(pid: int, seconds: float) -> int | None:
    """The exit status of child ``pid``, or None (after killing it) when it hangs."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None


@needs_fork
def test_a_forked_child_runs_parallel_forwards():
    """Each child's first forward starts its replicas together on new workers, with gradients
    recorded: torch's autograd engine is rebuilt there first (Note [Forked children]). Several
    children, as a race between replicas shows only in some."""
    net = _small_net().eval()
    dp = torchdp.DataParallel(net, devices=_devices("cpu", 3))
    x = torch.randn(6, 4)
    expected = net(x)
    torch.testing.assert_close(dp(x), expected)  # the parent's workers exist now
    for child in range(8):
        pid = os.fork()
        if pid == 0:  # the child: any failure is an exit status, never an exception into pytest
            code = 3
            try:
                _one_cpu_thread()
                for _ in range(3):
                    out = dp(x)
                code = 0 if torch.allclose(out, expected, atol=1e-6) else 4
            finally:
                os._exit(code)
        status = _wait_or_kill(pid, 60)
        assert status is not None, f"forked child {child} hung in its first parallel forward"
        assert status == 0, f"forked child {child} failed (exit status {status})"
    torch.testing.assert_close(dp(x), expected)  # the parent's workers still serve it


def _one_cpu_thread() -> None:
    """What a DataLoader worker does first. With torch's GNU OpenMP, a forked child hangs in its
    next multi-threaded CPU kernel whenever another thread of the parent ran one (plain torch, a
    Python thread and BatchNorm1d show it): that is OpenMP's, not the workers'."""
    torch.set_num_threads(1)


def _forward_in_child(queue) -> None:
    _one_cpu_thread()
    net = _FORK_STATE["net"]
    dp = _FORK_STATE["dp"]
    x = _FORK_STATE["x"]
    queue.put(torch.allclose(dp(x), net(x), atol=1e-6))


_FORK_STATE: dict[str, object] = {}


@needs_fork
def test_multiprocessing_fork_children_run_parallel_forwards():
    """The DataLoader-worker case: processes made by multiprocessing's 'fork' start method."""
    net = _small_net().eval()
    dp = torchdp.DataParallel(net, devices=_devices("cpu", 2))
    x = torch.randn(4, 4)
    dp(x)
    _FORK_STATE.update(net=net, dp=dp, x=x)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    children = [context.Process(target=_forward_in_child, args=(queue,)) for _ in range(2)]
    try:
        for child in children:
            child.start()
        results = [queue.get(timeout=60) for _ in children]
    finally:
        for child in children:
            child.join(10)
            if child.is_alive():
                child.kill()
        _FORK_STATE.clear()
    assert results == [True, True]
    assert all(child.exitcode == 0 for child in children)


# ---------------------------------------------------------------------------------------------
# Concurrent callers
# ---------------------------------------------------------------------------------------------


class Rendezvous(nn.Module):
    """Replicas that wait for each other inside forward (the synchronised-BatchNorm pattern):
    every replica of one call meets at a barrier shared by the replicas (a plain attribute)."""

    def __init__(self, parties: int) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.barrier = threading.Barrier(parties, timeout=20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.barrier.wait()
        return self.linear(x)


@pytest.mark.parametrize("kind", DEVICE_LISTS)
@pytest.mark.parametrize("n", [3, 4])
def test_two_threads_drive_wrappers_whose_replicas_synchronise(kind, n):
    steps = 40
    errors: list[BaseException] = []
    done = [0, 0]

    def drive(k: int) -> None:
        try:
            net = Rendezvous(n).to(kind)
            dp = torchdp.DataParallel(net, devices=_devices(kind, n))
            x = torch.randn(2 * n, 4, device=kind)
            for _ in range(steps):
                dp(x).sum().backward()
                done[k] += 1
        except BaseException as e:  # a broken barrier is the symptom of a deadlock
            errors.append(e)

    threads = [threading.Thread(target=drive, args=(k,), daemon=True) for k in range(2)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "the two callers deadlocked"
    assert not errors, f"a replica waited in vain for its call's other replicas: {errors[0]!r}"
    assert done == [steps, steps]
    assert time.monotonic() - start < 120


# ---------------------------------------------------------------------------------------------
# Repeated failures and interrupts
# ---------------------------------------------------------------------------------------------


class FailsOnDemand(nn.Module):
    """Raises in forward when its chunk holds a 99, and in backward when it holds a -99."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool((x == 99).any()):
            raise RuntimeError("forward failure on demand")
        out = self.linear(x)
        if bool((x == -99).any()):
            out = _FailInBackward.apply(out)
        return out


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward failure on demand")


@needs_proc
@pytest.mark.parametrize("kind", DEVICE_LISTS)
def test_many_failures_leak_no_thread_and_no_memory(kind):
    net = FailsOnDemand().to(kind)
    dp = torchdp.DataParallel(net, devices=_devices(kind, 3))
    good = torch.randn(6, 3, device=kind)
    bad_forward = good.clone()
    bad_forward[3, 0] = 99  # replica 1's chunk
    bad_backward = good.clone()
    bad_backward[5, 0] = -99  # replica 2's chunk
    dp(good).sum().backward()  # workers and caches exist from here on
    for _ in range(20):  # warm-up of the allocator and the failure paths
        with pytest.raises(RuntimeError):
            dp(bad_forward)
        with pytest.raises(RuntimeError):
            dp(bad_backward).sum().backward()
    gc.collect()
    threads, rss = _threads(), _rss_mb()
    for _ in range(200):
        with pytest.raises(RuntimeError, match="forward failure on demand"):
            dp(bad_forward)
        with pytest.raises(RuntimeError, match="backward failure on demand"):
            dp(bad_backward).sum().backward()
    gc.collect()
    assert _threads() == threads
    assert _rss_mb() - rss < 32, f"RSS grew from {rss:.1f} to {_rss_mb():.1f} MiB"
    net.zero_grad()
    dp(good).sum().backward()  # still works
    assert net.linear.weight.grad is not None


class Blocks(nn.Module):
    """Replica 1 signals ``started`` and then waits for ``release``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.started = threading.Event()
        self.release = threading.Event()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        if x.shape[0] == 1:  # replica 1's chunk
            self.started.set()
            self.release.wait(60)
        return self.linear(x)


@pytest.fixture
def sigint_raises():
    """Python's own SIGINT handler: a process started in the background by a non-interactive
    shell inherits SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_ctrl_c_during_a_forward(sigint_raises):
    net = Blocks()
    dp = torchdp.DataParallel(net, devices=_devices("cpu", 2))
    x = torch.randn(3, 3)  # chunks of 2 and 1 rows: only replica 1 blocks
    calls = net.calls.item()

    def interrupt() -> None:
        net.started.wait(10)
        time.sleep(0.1)
        _thread.interrupt_main()

    helper = threading.Thread(target=interrupt, daemon=True)
    helper.start()
    start = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            dp(x)
        assert time.monotonic() - start < 10
        helper.join(10)
        assert net.calls.item() == calls  # the interrupted forward's update was rolled back
    finally:
        net.release.set()
    net.started.clear()
    out = dp(torch.randn(4, 3))  # the wrapper works at once afterwards
    assert out.shape == (4, 3)


# ---------------------------------------------------------------------------------------------
# The buffer rollback of failed forwards
# ---------------------------------------------------------------------------------------------


def test_a_snapshot_does_not_roll_back_over_another_forward():
    """Note [Buffers of failed forwards]: a snapshot taken while another is held on the same
    tensors, or one that another snapshot followed, writes nothing back."""
    a = torch.zeros(3)
    first, second = torchdp._C.BufferSnapshot(), torchdp._C.BufferSnapshot()
    first.take([a])
    a.add_(1)
    second.take([a])  # a second forward starts while the first runs
    a.add_(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # warned once per process: seen in the script below
        assert first.restore() == 0
    assert second.restore() == 0
    assert torch.equal(a, torch.full((3,), 2.0))  # both forwards' updates kept
    first.release()
    second.release()
    third = torchdp._C.BufferSnapshot()
    third.take([a])
    a.add_(5)
    assert third.restore() == 1  # alone again: rolled back
    assert torch.equal(a, torch.full((3,), 2.0))
    third.release()
    fourth = torchdp._C.BufferSnapshot()
    fourth.take([a])
    third.take([a])  # taken again after fourth: fourth can no longer tell its changes apart
    a.add_(1)
    assert fourth.restore() == 0
    third.release()
    fourth.release()


ROLLBACK_SCRIPT = textwrap.dedent(
    """
    import threading, warnings
    import torch
    from torch import nn
    import torchdp

    class CountsAndFails(nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = nn.BatchNorm1d(3)

        def forward(self, x):
            out = self.bn(x)
            if bool((x == 99).any()):
                raise RuntimeError("replica failure on demand")
            return out

    net = CountsAndFails()
    devices = [torch.device("cpu")] * 2
    good, bad = torch.randn(8, 3), torch.randn(8, 3)
    bad[6, 0] = 99  # replica 1's chunk: replica 0 has updated the statistics by then
    failures = []

    def succeed():
        dp = torchdp.DataParallel(net, devices=devices)
        for _ in range(STEPS):
            dp(good)

    def fail():
        dp = torchdp.DataParallel(net, devices=devices)
        for _ in range(STEPS):
            try:
                dp(bad)
            except RuntimeError:
                failures.append(1)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        threads = [threading.Thread(target=succeed), threading.Thread(target=fail)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    tracked = int(net.bn.num_batches_tracked)
    rolled = [w for w in caught if "not rolled back" in str(w.message)]
    print(tracked, len(failures), len(rolled))
    """
)


def test_a_rollback_never_erases_another_threads_updates():
    steps = 300
    result = _python("-c", f"STEPS = {steps}\n" + ROLLBACK_SCRIPT, timeout=300)
    assert result.returncode == 0, result.stderr
    tracked, failures, warned = map(int, result.stdout.split())
    assert failures == steps
    # Every successful forward's update is kept (the failing ones may add theirs when they could
    # not be told apart), and the rollback that was skipped said so once.
    assert steps <= tracked <= 2 * steps
    assert warned <= 1
    if tracked > steps:
        assert warned == 1


class NormsAndFails(nn.Module):
    """BatchNorm, then a failure on demand (any 99 in its input)."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x):
        out = self.bn(x)
        if bool((x == 99).any()):
            raise RuntimeError("replica failure on demand")
        return out


class Outer(nn.Module):
    """A torchdp.DataParallel inside a module that is itself wrapped: nested forwards."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torchdp.DataParallel(NormsAndFails(), devices=[torch.device("cpu")] * 2)
        self.bn = nn.BatchNorm1d(3)

    def forward(self, x, fail_outer: bool = False):
        out = self.bn(self.inner(x))
        if fail_outer and bool((x == 98).any()):
            raise RuntimeError("outer replica failure on demand")
        return out


@pytest.mark.parametrize("where", ["inner", "outer"])
def test_nested_data_parallel_rolls_back_a_failed_forward(where):
    # Note [Nested forwards]: the inner wrapper's snapshot is not another thread's forward.
    net = Outer()
    dp = torchdp.DataParallel(net, devices=[torch.device("cpu")] * 2)
    dp(torch.randn(8, 3))  # a good step first: statistics that are not the initial ones
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x = torch.randn(8, 3)
    x[7, 0] = 99 if where == "inner" else 98  # in the outer replica 1's chunk, inner replica 1's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="failure on demand"):
            dp(x, fail_outer=where == "outer")
    assert not [w for w in caught if "not rolled back" in str(w.message)]
    for key, value in net.state_dict().items():
        assert torch.equal(value, before[key]), key
    dp(torch.randn(8, 3))  # and the next step updates them again
    assert int(net.bn.num_batches_tracked) == int(before["bn.num_batches_tracked"]) + 1


# ---------------------------------------------------------------------------------------------
# Ways in that must never crash the interpreter
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cache_replicas", [True, False])
@pytest.mark.parametrize("serial_forward", [False, True])
def test_jit_trace_of_a_data_parallel_raises_a_clear_error(cache_replicas, serial_forward):
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    dp = torchdp.DataParallel(
        net,
        devices=_devices("cpu", 2),
        cache_replicas=cache_replicas,
        serial_forward=serial_forward,
    )
    x = torch.randn(4, 4)
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"torch\.jit\.trace\(dp\.module"):
        torch.jit.trace(dp, x)
    for k, v in net.state_dict().items():
        assert torch.equal(v, before[k]), k
    torch.testing.assert_close(dp(x), net(x))  # the wrapper still works outside the trace
    traced = torch.jit.trace(dp.module, x)  # the fix the message names
    torch.testing.assert_close(traced(x), net(x))


def test_torch_func_transforms():
    net = nn.Linear(3, 2)
    dp = torchdp.DataParallel(net, devices=_devices("cpu", 2))
    x = torch.randn(4, 3)
    # As for torch.nn.DataParallel (a subclass), torch refuses its stateless API.
    with pytest.raises(RuntimeError, match="stateless API"):
        torch.func.functional_call(dp, dict(dp.named_parameters()), (x,))
    # The transforms raise before anything runs, naming the fix.
    for transform in (
        lambda: torch.func.vmap(dp)(x.unsqueeze(1)),
        lambda: torch.func.grad(lambda inp: dp(inp).sum())(x),
        lambda: torch.func.jacrev(dp)(x),
    ):
        with pytest.raises(RuntimeError, match=r"torch\.func transform[\s\S]*dp\.module"):
            transform()
    torch.testing.assert_close(torch.func.vmap(dp.module)(x), net(x))


def test_autograd_functional_jacobian():
    net = nn.Linear(3, 2)
    dp = torchdp.DataParallel(net, devices=_devices("cpu", 2))
    x = torch.randn(4, 3)
    jacobian = torch.autograd.functional.jacobian(dp, x)
    torch.testing.assert_close(jacobian, torch.autograd.functional.jacobian(net, x))


class Slow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return self.linear(x)


def test_a_wrapper_deleted_while_its_forward_runs():
    """The caller's last reference goes while another thread's forward runs: the forward keeps
    what it needs, finishes, and then the wrapper (with its kept replicas) is freed."""
    dp = torchdp.DataParallel(Slow(), devices=_devices("cpu", 3))
    alive = weakref.ref(dp)
    outputs = []
    thread = threading.Thread(target=lambda m: outputs.append(m(torch.randn(6, 3))), args=(dp,))
    thread.start()
    time.sleep(0.01)
    del dp
    gc.collect()
    thread.join(30)
    assert not thread.is_alive()
    assert outputs and outputs[0].shape == (6, 3)
    outputs.clear()
    del thread
    gc.collect()
    assert alive() is None


# A daemon thread keeps the workers busy with Python functions while the interpreter exits: the
# workers, the waiting caller (its Ctrl-C polls, taking the GIL back) and the serial path all ask
# for the GIL after finalization began. No tensor is made or freed in the loop: torch's own GIL
# requests (ops, tensor deallocation, autograd) can still end a daemon thread at exit with
# std::terminate, with or without torchdp (docs/troubleshooting.md).
EXIT_SCRIPT = textwrap.dedent(
    """
    import threading, time
    import torch
    from torchdp import _C

    devices = [torch.device("cpu")] * 3

    def slow():
        time.sleep(0.01)
        return [1, 2]

    fns = [slow] * 3
    started = threading.Event()

    def loop():
        while True:
            started.set()
            _C.parallel_apply(fns, devices, SERIAL)

    threading.Thread(target=loop, daemon=True).start()
    started.wait(10)
    time.sleep(DELAY)
    print("exiting")
    """
)


@pytest.mark.parametrize("serial", [False, True])
@pytest.mark.parametrize("delay", [0.0, 0.005, 0.01, 0.03])
def test_interpreter_exit_in_the_middle_of_parallel_apply(delay, serial):
    # CPython (before 3.14) ends a daemon thread that asks for the GIL during finalization with
    # pthread_exit; torchdp parks it instead of unwinding frames that hold Python objects.
    script = f"DELAY = {delay}\nSERIAL = {serial}\n" + EXIT_SCRIPT
    result = _python("-c", script, timeout=120)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.strip() == "exiting"


# ---------------------------------------------------------------------------------------------
# The soak command
# ---------------------------------------------------------------------------------------------

SOAK = os.path.join(os.path.dirname(__file__), "soak.py")


def _soak(*args: str) -> subprocess.CompletedProcess[str]:
    return _python(SOAK, *args, timeout=600)


@needs_proc
def test_soak_smoke():
    result = _soak("--steps", "200", "--devices", "cpu,cpu", "--every", "50", "--warmup", "50")
    assert result.returncode == 0, result.stderr
    reports = [line for line in result.stdout.splitlines() if line.startswith("step")]
    assert len(reports) == 4  # steps 50 (the baseline), 100, 150, 200
    assert all("RSS" in line and "threads" in line for line in reports)
    assert result.stdout.rstrip().endswith("passed (200 steps, every bound held)")


@needs_proc
def test_soak_fails_when_a_bound_is_exceeded():
    # A bound no run can hold (the thread count must shrink): the exit status says so.
    result = _soak(
        "--steps",
        "40",
        "--devices",
        "cpu,cpu",
        "--every",
        "20",
        "--warmup",
        "20",
        "--threads-bound",
        "-1",
    )
    assert result.returncode == 1
    assert "threads grew by" in result.stderr


# ---------------------------------------------------------------------------------------------
# Errors that say what, and where
# ---------------------------------------------------------------------------------------------


class TakesTwo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + extra.sum()


def test_a_short_positional_tensor_is_refused_like_a_keyword_one():
    net = TakesTwo()
    dp = torchdp.DataParallel(net, devices=_devices("cpu", 2))
    x, short = torch.randn(8, 3), torch.randn(1, 3)
    with pytest.raises(
        ValueError,
        match=r"positional argument 0 has 8 but positional argument 1 has 1, which splits into "
        r"only 1 chunk",
    ):
        dp(x, short)
    with pytest.raises(AssertionError, match="kwargs_tup"):
        dp(x, extra=short)  # the keyword form: PyTorch's assertion, with the cause
    with pytest.raises(ValueError, match="positional argument 1 has 1"):
        torchdp.data_parallel(net, (x, short), devices=_devices("cpu", 2))
    # A batch smaller than the device list still runs fewer replicas, as in PyTorch.
    assert dp(torch.randn(1, 3), torch.randn(1, 3)).shape == (1, 3)


class RefusesTensors(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.ones(3))

    def __setattr__(self, name, value):
        if name == "mask" and getattr(self, "_locked", False):
            raise AttributeError("mask is read-only")
        super().__setattr__(name, value)

    def forward(self, x):
        return x * self.mask


def test_a_failing_setattr_during_replication_names_the_module_path():
    inner = RefusesTensors()
    net = nn.Sequential(nn.Identity(), nn.Sequential(inner))
    inner._locked = True
    with pytest.raises(
        AttributeError, match=r"module '1\.0' \(class RefusesTensors[\s\S]*read-only"
    ):
        torchdp.replicate(net, _devices("cpu", 2))
