import time, torch, torchdp, torchvision
from torch import nn
from torch.profiler import profile, ProfilerActivity
d0=torch.device("cuda",0)
m=torchvision.models.resnet50().to(d0)
def t(fn, n=20, sync=True):
    for _ in range(3): fn()
    torch.cuda.synchronize(); s=time.perf_counter()
    for _ in range(n): fn()
    if sync: torch.cuda.synchronize()
    return (time.perf_counter()-s)/n*1e3
for devs in ([d0],[d0,d0]):
    print(len(devs), "sync", t(lambda: torchdp.replicate(m, devs)), "nosync", t(lambda: torchdp.replicate(m, devs), sync=False))
ps=list(m.parameters()); bs=list(m.buffers())
print("bcast params diff", t(lambda: torchdp._C.broadcast_coalesced(ps, [d0,d0], differentiable=True)))
print("bcast params nodiff", t(lambda: torchdp._C.broadcast_coalesced(ps, [d0,d0])))
print("bcast buffers", t(lambda: torchdp._C.broadcast_coalesced(bs, [d0,d0])))
print("_C.replicate", t(lambda: torchdp._C.replicate(m, [d0,d0], False)))
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(5): torchdp.replicate(m, [d0,d0])
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10))
