#!/usr/bin/env python3
"""The PyTorch side of the GPT comparison (benches/README.md): nanoGPT's model (pre-LN
blocks, GELU tanh, no dropout, biases) in the shape `train_gpt` trains — 4 layers,
4 heads, width 128, context 64, batch 12, an untied head, AdamW(lr 1e-3, betas
0.9/0.99, weight decay 0.1 on the matrices) — on the same corpus and split.

    python3 benches/gpt_torch.py --threads 1 --iters 60          # speed and memory
    python3 benches/gpt_torch.py --threads 1 --iters 2000 --eval  # the loss it reaches

Prints one JSON object: `step_ms_median` (steps after the first 10),
`training_rss_growth_bytes` (RSS after 10 steps minus RSS before the first),
`params`, `val_loss` (with --eval: the mean over 20 random validation batches).
Outside CI: it needs `torch` (pip install torch), which carve does not.
"""
import argparse
import gzip
import json
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


def rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, d, heads, layers, context):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--eval", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    here = os.path.dirname(os.path.abspath(__file__))
    with gzip.open(os.path.join(here, "..", "examples", "data", "shakespeare.txt.gz"), "rt", encoding="utf-8") as f:
        text = f.read()
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    split = len(data) * 9 // 10
    train, val = data[:split], data[split:]
    context, batch = 64, 12

    def get_batch(d):
        ix = torch.randint(len(d) - context, (batch,))
        return torch.stack([d[i:i + context] for i in ix]), torch.stack([d[i + 1:i + 1 + context] for i in ix])

    model = GPT(len(chars), 128, 4, 4, context)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.99)
    )
    params = sum(p.numel() for p in model.parameters())
    before = rss()
    after = before
    times = []
    for it in range(args.iters):
        x, y = get_batch(train)
        t0 = time.perf_counter()
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        if it + 1 == 10:
            after = rss()
    steady = sorted(times[10:] or times)
    out = {
        "threads": args.threads,
        "torch": torch.__version__,
        "params": params,
        "step_ms_median": 1e3 * steady[len(steady) // 2],
        "training_rss_growth_bytes": after - before,
        "train_loss": loss.item(),
    }
    if args.eval:
        model.eval()
        with torch.no_grad():
            out["val_loss"] = sum(float(model(*get_batch(val))) for _ in range(20)) / 20
    print(json.dumps(out))


if __name__ == "__main__":
    main()
