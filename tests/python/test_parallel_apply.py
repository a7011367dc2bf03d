"""torchdp.parallel_apply on CPU device lists: argument checks, calling conventions, grad mode and
autocast state in the workers, and PyTorch's "Caught X in replica i on device d" errors."""

from __future__ import annotations

import _thread
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from dp_testing import cpu_devices
from torch import nn

import torchdp

CPU = torch.device("cpu")
_PYTHON_DIR = os.path.dirname(os.path.dirname(torchdp.__file__))
META = torch.device("meta")


class Echo(nn.Module):
    def forward(self, *args, **kwargs):
        return args, kwargs


class Probe(nn.Module):
    def forward(self, x):
        return {
            "thread": threading.get_ident(),
            "grad": torch.is_grad_enabled(),
            "autocast": torch.is_autocast_enabled("cpu"),
            "dtype": torch.get_autocast_dtype("cpu"),
        }


class Raises(nn.Module):
    def __init__(self, exc: BaseException | None) -> None:
        super().__init__()
        self.exc = exc

    def forward(self, x):
        if self.exc is not None:
            raise self.exc
        return x


def test_inputs_as_tuples_single_objects_and_kwargs():
    modules = [Echo(), Echo(), Echo()]
    t = torch.ones(2)
    outs = torchdp.parallel_apply(
        modules, [(t, 1), t, [2, 3]], ({"k": 1}, {}, {"z": None}), cpu_devices(3)
    )
    assert outs[0][0][0] is t and outs[0][0][1] == 1 and outs[0][1] == {"k": 1}
    assert len(outs[1][0]) == 1 and outs[1][0][0] is t  # a tensor is never sliced
    assert outs[2][0] == (2, 3) and outs[2][1] == {"z": None}


def test_kwargs_tup_and_devices_default():
    outs = torchdp.parallel_apply(
        [nn.Linear(2, 1), nn.Linear(2, 1)], [torch.ones(1, 2), torch.ones(1, 2)]
    )
    assert [o.shape for o in outs] == [torch.Size([1, 1])] * 2


def test_no_modules():
    assert torchdp.parallel_apply([], []) == []


def test_inputs_length_mismatch():
    with pytest.raises(
        AssertionError, match="The number of modules 2 is not equal to the number of inputs 1"
    ):
        torchdp.parallel_apply([Echo(), Echo()], [1])


def test_kwargs_length_mismatch():
    with pytest.raises(
        AssertionError, match="The number of modules 2 is not equal to the number of kwargs_tup 3"
    ):
        torchdp.parallel_apply([Echo(), Echo()], [1, 2], ({}, {}, {}))


def test_devices_length_mismatch():
    with pytest.raises(
        AssertionError, match="The number of modules 2 is not equal to the number of devices 1"
    ):
        torchdp.parallel_apply([Echo(), Echo()], [1, 2], None, cpu_devices(1))


@pytest.mark.parametrize("grad_enabled", [True, False])
def test_grad_mode_is_carried_into_workers(grad_enabled):
    with torch.set_grad_enabled(grad_enabled):
        outs = torchdp.parallel_apply([Probe()] * 3, [0, 0, 0], None, cpu_devices(3))
    assert [o["grad"] for o in outs] == [grad_enabled] * 3


def test_autocast_state_is_carried_into_workers():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = torchdp.parallel_apply([Probe()] * 3, [0, 0, 0], None, cpu_devices(3))
    assert [o["autocast"] for o in outs] == [True] * 3
    assert [o["dtype"] for o in outs] == [torch.bfloat16] * 3
    outs = torchdp.parallel_apply([Probe()] * 2, [0, 0], None, cpu_devices(2))
    assert [o["autocast"] for o in outs] == [False] * 2


def test_replica_zero_runs_on_the_calling_thread_and_workers_persist():
    first = torchdp.parallel_apply([Probe()] * 3, [0, 0, 0], None, cpu_devices(3))
    second = torchdp.parallel_apply([Probe()] * 3, [0, 0, 0], None, cpu_devices(3))
    main = threading.get_ident()
    assert first[0]["thread"] == main
    assert all(o["thread"] != main for o in first[1:])
    assert len({o["thread"] for o in first}) == 3
    # Persistent workers: no new thread per call.
    assert [o["thread"] for o in first] == [o["thread"] for o in second]


def test_key_error_is_reraised_readably():
    modules = [Raises(None), Raises(KeyError("wonderful")), Raises(KeyError("later"))]
    with pytest.raises(
        KeyError,
        match=r"Caught KeyError in replica 1 on device cpu.\nOriginal "
        r"Traceback[\s\S]+wonderful",
    ) as info:
        torchdp.parallel_apply(modules, [1, 2, 3], None, cpu_devices(3))
    # KeyErrorMessage: str() of the exception is the message itself, not its repr.
    assert str(info.value).startswith("Caught KeyError in replica 1 on device cpu.")
    assert "later" not in str(info.value)


def test_first_exception_wins_and_keeps_its_type():
    modules = [Raises(ValueError("zero")), Raises(TypeError("one"))]
    with pytest.raises(
        ValueError,
        match=r"Caught ValueError in replica 0 on device cpu.\n"
        r"Original Traceback[\s\S]+zero",
    ):
        torchdp.parallel_apply(modules, [1, 2], None, cpu_devices(2))


def test_exception_that_cannot_be_rebuilt_becomes_runtime_error():
    class Picky(Exception):
        def __init__(self, a, b):
            super().__init__(a, b)

    with pytest.raises(RuntimeError, match=r"Caught Picky in replica 1 on device meta"):
        torchdp.parallel_apply([Raises(None), Raises(Picky(1, 2))], [1, 2], None, [CPU, META])


def test_device_is_printed_like_pytorch():
    with pytest.raises(ZeroDivisionError, match="in replica 0 on device cpu"):
        torchdp.parallel_apply([Raises(ZeroDivisionError("x"))], [1], None, ["cpu:0"])


def test_error_inside_data_parallel_names_the_replica():
    class FailsOnSmallBatch(nn.Module):
        def forward(self, x):
            if x.shape[0] < 3:
                raise IndexError("batch too small")
            return x

    dp = torchdp.DataParallel(FailsOnSmallBatch(), devices=cpu_devices(2))
    with pytest.raises(IndexError, match=r"Caught IndexError in replica 1 on device cpu"):
        dp(torch.randn(5, 1))  # chunks of 3 and 2


# --- serial=True (csrc/python/bind_core.cpp, Note [Serial replicas]) -----------------------------


def test_serial_runs_in_order_on_the_calling_thread():
    order: list[int] = []

    class Record(nn.Module):
        def __init__(self, i: int) -> None:
            super().__init__()
            self.i = i

        def forward(self, x):
            order.append(self.i)
            return threading.get_ident(), x * self.i

    outs = torchdp.parallel_apply(
        [Record(i) for i in range(3)], [torch.ones(2)] * 3, None, cpu_devices(3), serial=True
    )
    assert order == [0, 1, 2]
    assert all(o[0] == threading.get_ident() for o in outs)
    for i, o in enumerate(outs):
        torch.testing.assert_close(o[1], torch.full((2,), float(i)))


def test_serial_keeps_grad_mode_autocast_and_the_error_rule():
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        outs = torchdp.parallel_apply([Probe()] * 2, [0, 0], None, cpu_devices(2), serial=True)
    assert [(o["grad"], o["autocast"], o["dtype"]) for o in outs] == [
        (False, True, torch.bfloat16)
    ] * 2
    ran: list[int] = []

    class Mark(Raises):
        def forward(self, x):
            ran.append(x)
            return super().forward(x)

    modules = [Mark(None), Mark(KeyError("one")), Mark(ValueError("two"))]
    with pytest.raises(KeyError, match="Caught KeyError in replica 1 on device cpu"):
        torchdp.parallel_apply(modules, [0, 1, 2], None, cpu_devices(3), serial=True)
    assert ran == [0, 1, 2]  # every replica ran, as with workers
    # Ctrl-C in a replica stops there: the replicas after it do not run.
    ran.clear()
    modules = [Mark(None), Mark(KeyboardInterrupt()), Mark(None)]
    with pytest.raises(KeyboardInterrupt):
        torchdp.parallel_apply(modules, [0, 1, 2], None, cpu_devices(3), serial=True)
    assert ran == [0, 1]


@pytest.mark.parametrize("n", [2, 3])
def test_data_parallel_serial_forward_equals_the_module(n):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    ref = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))
    ref.load_state_dict(net.state_dict())
    dp = torchdp.DataParallel(net, devices=cpu_devices(n), serial_forward=True)
    assert dp.serial_forward
    x = torch.randn(8, 5)
    out = dp(x)
    torch.testing.assert_close(out, ref(x))
    out.pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for p, q in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


class Blocks(nn.Module):
    """Signals ``started`` and then waits for ``release`` (a replica that hangs)."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()
        self.release = threading.Event()
        self.finished = threading.Event()
        self.thread: int | None = None

    def forward(self, x):
        self.thread = threading.get_ident()
        self.started.set()
        self.release.wait(60)
        self.finished.set()
        return x


def _interrupt_main_when(event: threading.Event, delay: float) -> threading.Thread:
    def run() -> None:
        event.wait(10)
        time.sleep(delay)
        _thread.interrupt_main()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.fixture
def sigint_raises():
    """Python's own SIGINT handler for the test: a process started in the background by a
    non-interactive shell inherits SIGINT ignored, and then Python installs none."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("delay", [0.0, 0.2])
def test_ctrl_c_interrupts_a_wait_for_a_hung_replica(delay, sigint_raises):
    hung = Blocks()
    try:
        helper = _interrupt_main_when(hung.started, delay)
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            torchdp.parallel_apply([Probe(), hung], [0, 0], None, cpu_devices(2))
        assert time.monotonic() - start < 10
        helper.join(10)
        assert not hung.finished.is_set()
        # The hung replica's worker slot runs the next call on a fresh thread, at once (a call
        # queued behind the hung replica would wait until it is released).
        start = time.monotonic()
        outs = torchdp.parallel_apply([Probe(), Probe()], [0, 0], None, cpu_devices(2))
        assert time.monotonic() - start < 10
        assert hung.thread is not None
        assert outs[1]["thread"] not in (threading.get_ident(), hung.thread)
        assert torchdp.parallel_apply([Raises(None)] * 2, [1, 2], None, cpu_devices(2)) == [1, 2]
        assert not hung.finished.is_set()
    finally:
        hung.release.set()
    # The abandoned replica finishes on its own; its result is dropped.
    assert hung.finished.wait(10)
    outs = torchdp.parallel_apply([Probe(), Probe()], [0, 0], None, cpu_devices(2))
    assert len({o["thread"] for o in outs}) == 2


_EXIT_WHILE_A_REPLICA_RUNS = """
import _thread, signal, sys, threading, time
import torch
from torch import nn
import torchdp

signal.signal(signal.SIGINT, signal.default_int_handler)
started = threading.Event()


class Hangs(nn.Module):
    def forward(self, x):
        started.set()
        while True:
            {body}


def fire():
    started.wait(10)
    time.sleep(0.1)
    _thread.interrupt_main()


threading.Thread(target=fire, daemon=True).start()
try:
    torchdp.parallel_apply([nn.Identity(), Hangs()], [torch.ones(2)] * 2, None,
                           [torch.device("cpu")] * 2)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(3)
"""


@pytest.mark.parametrize(
    "body", ["time.sleep(0.001)", "threading.Event().wait(0.001)"], ids=["sleep", "event"]
)
def test_exit_after_ctrl_c_while_a_replica_still_runs_is_clean(body):
    # At exit Python ends a thread that asks for the GIL (pthread_exit); the abandoned replica's
    # worker must let that unwinding through (no abort, no crash in the GIL guard).
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PYTHON_DIR, env.get("PYTHONPATH")]))
    for _ in range(3):
        done = subprocess.run(
            [sys.executable, "-c", _EXIT_WHILE_A_REPLICA_RUNS.format(body=body)],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 3, done.stdout + done.stderr
        assert "interrupted" in done.stdout


def test_keyboard_interrupt_in_replica_zero_does_not_wait_for_a_hung_replica(sigint_raises):
    hung = Blocks()
    try:
        with pytest.raises(KeyboardInterrupt):
            torchdp.parallel_apply(
                [Raises(KeyboardInterrupt()), hung], [0, 0], None, cpu_devices(2)
            )
        assert hung.started.wait(10)
        assert not hung.finished.is_set()
    finally:
        hung.release.set()
    assert hung.finished.wait(10)
