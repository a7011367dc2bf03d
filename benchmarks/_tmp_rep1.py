import time, torch, torchdp, torchvision
from torch import nn
from torch.nn.parallel import replicate as trep
def t(fn, n=20):
    for _ in range(3): fn()
    torch.cuda.synchronize(); s=time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize()
    return (time.perf_counter()-s)/n*1e3
d0=torch.device("cuda",0)
models={"resnet50": torchvision.models.resnet50(),
 "transformer": nn.TransformerEncoder(nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True), 12),
 "mlp200": nn.Sequential(*[m for _ in range(200) for m in (nn.Linear(256,256), nn.ReLU())])}
for name, m in models.items():
    m=m.to(d0)
    a=t(lambda: trep(m, [0])); b=t(lambda: torchdp.replicate(m, [0]))
    c=t(lambda: torchdp.replicate(m, [d0, d0]))
    print(f"{name}: torch replicate 1 dev {a:.2f} ms, torchdp 1 dev {b:.2f} ms ({a/b:.1f}x), torchdp [0,0] {c:.2f} ms")
# train step mlp200 on [0,0] with bucket sizes
m=models["mlp200"]; x=torch.randn(512,256,device=d0)
import os
for mib in ["0","25"]:
    os.environ["TORCHDP_GRAD_BUCKET_MB"]=mib
    dp=torchdp.DataParallel(m, devices=[d0,d0])
    def step():
        m.zero_grad(); dp(x).pow(2).mean().backward()
    print("mlp200 [0,0] step, bucket", mib, f"{t(step):.2f} ms")
