"""Threads: replicas run with the caller's intra-op thread count (Note [Intra-op threads of
workers] in csrc/torchdp/parallel_apply.cpp), and one DataParallel driven from several Python
threads at once, with the GIL off on a free-threaded build (Note [Free-threaded Python] in
csrc/python/py_dict.h)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import threading

import pytest
import torch
from dp_testing import cpu_devices
from torch import nn

import torchdp
from torchdp.data_parallel import _REPLICA_CACHES

_PYTHON_DIR = os.path.dirname(os.path.dirname(torchdp.__file__))
FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PYTHON_DIR, env.get("PYTHONPATH")]))
    # The defaults are what is tested; and CPython's own default for the GIL.
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHON_GIL"):
        env.pop(name, None)
    return env


class ThreadCount(nn.Module):
    """Returns, per sample, the intra-op thread count its replica's forward saw."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.lin(x)
        return torch.full((x.shape[0], 1), float(torch.get_num_threads()))


def test_replicas_see_the_callers_intra_op_thread_count():
    dp = torchdp.DataParallel(ThreadCount(), devices=cpu_devices(3))
    before = torch.get_num_threads()
    seen = {}
    try:
        # Twice each, and back: a worker must follow every change, not only its first task's.
        for k in (1, 3, 2, 1, 3):
            torch.set_num_threads(k)
            seen[k] = dp(torch.ones(6, 4)).flatten().tolist()
    finally:
        torch.set_num_threads(before)
    assert seen == {k: [float(k)] * 6 for k in seen}


_OS_THREADS = """
import os, time, torch, torchdp
from torch import nn

torch.set_num_threads({first})
torch.manual_seed(0)
net = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(256, 256), nn.ReLU())])
x = torch.randn(512, 256)
dp = torchdp.DataParallel(net, devices=[torch.device("cpu")] * {n})


def cpu_of_threads():
    out = {{}}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{{tid}}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[tid] = int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
    return out


def steps(model, k=5):
    for _ in range(k):
        model(x).sum().backward()


steps(net, 3)
alone = len(cpu_of_threads())
steps(dp)
with torch.no_grad():
    dp(x)
grown = len(cpu_of_threads()) - alone
torch.set_num_threads(1)
time.sleep(0.5)  # idle OpenMP threads stop spinning
before = cpu_of_threads()
steps(dp, 10)
after = cpu_of_threads()
busy = sum(1 for tid, ticks in after.items() if ticks > before.get(tid, 0))
print(grown, busy)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores for a default team")
@pytest.mark.parametrize("first", ["1", "default"])
@pytest.mark.parametrize("n", [2, 3])
def test_one_intra_op_thread_means_one_busy_thread_per_replica(n, first):
    # After torch.set_num_threads(1) only the calling thread and the n - 1 workers run, also when
    # the replicas first ran at the default count: a worker that kept its first setting would go
    # on with an OpenMP team. With one thread from the start the workers are all that appear.
    threads = "1" if first == "1" else "torch.get_num_threads()"
    done = subprocess.run(
        [sys.executable, "-c", _OS_THREADS.format(n=n, first=threads)],
        check=False,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    grown, busy = map(int, done.stdout.split())
    assert busy == n
    if first == "1":
        assert grown == n - 1


class Mlp(nn.Module):
    """Python-bound: a loop of small layers, and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))
        self.register_buffer("shift", torch.linspace(-1, 1, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x) + self.shift)
        return x


def test_one_wrapper_driven_from_several_threads():
    # Forwards with backward and under no_grad, from four threads at once, on one wrapper and its
    # replica cache: every output is right, the gradients add up, and the cache still works.
    torch.manual_seed(0)
    net = Mlp()
    dp = torchdp.DataParallel(net, devices=cpu_devices(2))
    threads, rounds = 4, 30
    xs = [torch.randn(6, 8) for _ in range(threads)]
    expected, grads = [], []
    for x in xs:
        net.zero_grad(set_to_none=True)
        out = net(x)
        out.pow(2).sum().backward()
        expected.append(out.detach())
        grads.append([p.grad.clone() for p in net.parameters()])
    net.zero_grad(set_to_none=True)
    start = threading.Barrier(threads)
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            start.wait()
            for r in range(rounds):
                if r % 3 == 2:
                    with torch.no_grad():
                        torch.testing.assert_close(dp(xs[k]), expected[k])
                else:
                    out = dp(xs[k])
                    torch.testing.assert_close(out.detach(), expected[k])
                    out.pow(2).sum().backward()
        except BaseException as e:
            errors.append(e)

    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    assert not errors, repr(errors[0])
    backwards = sum(1 for r in range(rounds) if r % 3 != 2)
    for i, p in enumerate(net.parameters()):
        total = sum(g[i] for g in grads) * backwards
        torch.testing.assert_close(p.grad, total, rtol=1e-4, atol=1e-4)
    cache = _REPLICA_CACHES[dp]
    assert cache.builds + cache.reuses == threads * rounds
    # Alone again: after one forward, each next reuses the kept replicas (never without the GIL).
    with torch.no_grad():
        torch.testing.assert_close(dp(xs[0]), expected[0])
        reuses = cache.reuses
        for _ in range(2):
            torch.testing.assert_close(dp(xs[0]), expected[0])
    assert cache.reuses == reuses + (0 if FREE_THREADED else 2)


@pytest.mark.skipif(not FREE_THREADED, reason="needs a free-threaded Python")
def test_import_leaves_the_gil_off():
    # CPython turns the GIL back on, with a RuntimeWarning, for an extension that does not declare
    # free-threading support; -W error makes that warning fail the import.
    code = "import sys, torchdp, torchdp._C; print(sys._is_gil_enabled())"
    done = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-c", code],
        check=False,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["False"]
