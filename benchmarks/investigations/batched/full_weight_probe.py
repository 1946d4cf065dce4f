"""Investigation (one-off probe): GPT-2 12 x 768 (random init, seed 0), B = 64 WikiText blocks of 16 tokens (960 inputs
> 768): the first layer's rank, and each MLP down-projection's whitened energy fraction of the true next token's input
against wrong bag tokens after the true prefix (position 8), whitened by 512 test.txt blocks.

    OMP_NUM_THREADS=1 python -m benchmarks.investigations.batched.full_weight_probe 64
"""


import sys
import time
from pathlib import Path

import torch

from benchmarks.dager_benchmark import blocks, gpt2_tokenizer
from datamodules.targets import HFCausalLM

torch.manual_seed(0)
tok = gpt2_tokenizer()
valid = blocks(Path(__file__).resolve().parents[3].parent / Path("shared/data/wikitext-2/valid.txt"), tok, 16, 512)
aux = blocks(Path(__file__).resolve().parents[3].parent / Path("shared/data/wikitext-2/test.txt"), tok, 16, 512)
m = HFCausalLM(architecture="gpt2", init_seed=0)
lm = m.model
lm.eval()
B = int(sys.argv[1]) if len(sys.argv) > 1 else 64
ids = torch.tensor(valid[:B])
names = [f"transformer.h.{i}.mlp.c_proj" for i in range(12)]
mods = dict(lm.named_modules())
def capture(run):
    out = {}
    hs = [mods[n].register_forward_pre_hook(lambda mod, a, n=n: out.__setitem__(n, a[0].detach())) for n in names]
    try:
        run()
    finally:
        for h in hs:
            h.remove()
    return [out[n] for n in names]
t = time.time()
with torch.no_grad():
    acts = []
    for part in torch.tensor(aux).split(64):
        acts.append(torch.stack([a.reshape(-1, 3072).double() for a in capture(lambda: lm(part))]))
    A = torch.cat(acts, 1)
    M = A.transpose(1, 2) @ A / A.shape[1]
    vals, vecs = torch.linalg.eigh(M)
    vals = vals.clamp_min(vals[:, -1:] * 1e-6)
    W = vecs @ torch.diag_embed(vals.rsqrt()) @ vecs.transpose(1, 2)
print("whitening", time.time() - t, A.shape)
lm.zero_grad()
out = lm(input_ids=ids, labels=ids)
out.loss.backward()
g0 = lm.transformer.h[0].attn.c_attn.weight.grad  # (768, 2304) in_out
print("first-layer rank", torch.linalg.matrix_rank(g0.double(), rtol=1e-6).item(), "distinct", ids[:, :-1].unique().numel())
rows = [mods[n].weight.grad.T.double() for n in names]  # (768, 3072)
bases = []
for r, w in zip(rows, W):
    z = (r @ w).T  # (3072, 768)
    u, s, _ = torch.linalg.svd(z, full_matrices=False)
    bases.append(u[:, s > 1e-6 * s[0]])
print("site ranks", [b.shape[1] for b in bases])
bag = ids[:, :-1].unique()
with torch.no_grad():
    # true inputs at every input position, and for position p the inputs of prefix + wrong bag token
    true_in = capture(lambda: lm(ids[:, :-1]))
    def frac(x, s):
        z = x.double().reshape(-1, 3072) @ W[s]
        return ((z @ bases[s]).pow(2).sum(1) / z.pow(2).sum(1))
    print("site: true frac mean / wrong frac mean")
    p = 8
    wrong_ids = ids[:8, :p + 1].repeat_interleave(32, 0).clone()
    wrong_ids[:, p] = bag[torch.randint(0, bag.numel(), (wrong_ids.shape[0],))]
    wrong_in = capture(lambda: lm(wrong_ids))
    tot_t, tot_w = 0, 0
    for s in range(12):
        ft = frac(true_in[s][:, p], s)
        fw = frac(wrong_in[s][:, p], s)
        tot_t = tot_t + ft.log()[:8].repeat_interleave(32)
        tot_w = tot_w + fw.log()
        print(s, round(ft.mean().item(), 3), round(fw.mean().item(), 3))
    print("sum log: true", tot_t[::32].tolist()[:4], "wrong mean", tot_w.mean().item(), "frac wrong >= true", (tot_w >= tot_t).double().mean().item())
