import os, sys, time, copy, statistics
sys.path.insert(0, os.path.dirname(__file__))
import torch, torchdp
from bench_train_step import build_model, make_inputs, make_step, disable_dropout
from torch.profiler import profile, ProfilerActivity
d0 = torch.device("cuda", 0)
def timeit(step, warm=3, n=8):
    for _ in range(warm): step()
    torch.cuda.synchronize(); ts=[]
    for _ in range(n):
        s=time.perf_counter(); step(); torch.cuda.synchronize(); ts.append((time.perf_counter()-s)*1e3)
    return statistics.median(ts)
for name in ["mlp200", "transformer", "resnet50"]:
    master = build_model(name, False); disable_dropout(master)
    x, tgt = make_inputs(name, False)
    x = x.to(d0); tgt = tgt.to(d0) if tgt is not None else None
    res = {}
    for mode in ["single", "threads", "serial", "threads-b0", "serial-b0"]:
        os.environ["TORCHDP_GRAD_BUCKET_MB"] = "0" if mode.endswith("b0") else "25"
        model = copy.deepcopy(master).to(d0)
        wrapped = model if mode == "single" else torchdp.DataParallel(model, devices=[d0, d0], serial_forward=mode.startswith("serial"))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        step = make_step(name, wrapped, opt, x, tgt, "fp32", "cuda")
        res[mode] = timeit(step)
        if name == "mlp200" and mode in ("single", "threads", "serial"):
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(2): step()
                torch.cuda.synchronize()
            print(f"--- {name} {mode} profile (2 steps)")
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14))
        del model, wrapped, opt, step
        torch.cuda.empty_cache()
    print(name, {k: round(v, 2) for k, v in res.items()}, flush=True)
