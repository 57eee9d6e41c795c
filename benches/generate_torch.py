#!/usr/bin/env python3
"""The PyTorch side of the generation comparison (benches/README.md, "Generation"):
nanoGPT's model in `train_gpt`'s shape (4 layers, 4 heads, width 128, context 64, 77
symbols), generating greedily with a key/value cache of its own — per layer a
preallocated `[streams, heads, context, head width]` buffer for the keys and one for
the values, written in place — and the window sliding as carve's does (when the cache is
full, the last `context / 2` tokens are run again from position 0).

    python3 benches/generate_torch.py --threads 1 --tokens 1000 --streams 1
    python3 benches/generate_torch.py --threads 1 --tokens 1000 --streams 16

Prints one JSON object: `tokens_per_sec` (every stream's tokens over the time of the
token steps), `token_us_p50`, `token_us_p99` (per step of all streams), `rss_bytes`.
Outside CI: it needs `torch` (pip install torch), which carve does not.
"""
import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt_torch import rss  # this directory's training comparison: the same reading of VmRSS


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d)
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.mlp_proj = nn.Linear(4 * d, d)

    def forward(self, x, cache, pos):
        """`x`: [streams, steps, d] at positions `pos ..`; `cache`: (keys, values)."""
        b, t, d = x.shape
        h = self.heads
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q = q.view(b, t, h, d // h).transpose(1, 2)
        k = k.view(b, t, h, d // h).transpose(1, 2)
        v = v.view(b, t, h, d // h).transpose(1, 2)
        keys, values = cache
        keys[:, :, pos:pos + t] = k
        values[:, :, pos:pos + t] = v
        end = pos + t
        # The new steps attend to every cached step up to themselves.
        mask = torch.ones(t, end, dtype=torch.bool).tril(diagonal=pos)
        y = F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end], attn_mask=mask)
        y = y.transpose(1, 2).contiguous().view(b, t, d)
        x = x + self.c_proj(y)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, d, heads, layers, context):
        super().__init__()
        self.context, self.heads, self.d = context, heads, d
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(context, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab)

    def cache(self, streams):
        shape = (streams, self.heads, self.context, self.d // self.heads)
        return [(torch.zeros(shape), torch.zeros(shape)) for _ in self.h]

    def forward(self, idx, caches, pos):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(pos, pos + t))
        for block, cache in zip(self.h, caches):
            x = block(x, cache, pos)
        return self.lm_head(self.ln_f(x[:, -1]))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    vocab, d, heads, layers, context = 77, 128, 4, 4, 64
    model = GPT(vocab, d, heads, layers, context).eval()
    caches = model.cache(a.streams)
    window = torch.zeros(a.streams, 1, dtype=torch.long)
    keep = max(context // 2, 1)
    steps = []
    with torch.inference_mode():
        logits = model(window, caches, 0)
        pos = 1
        history = [window]
        start = time.perf_counter()
        for _ in range(a.tokens):
            t0 = time.perf_counter()
            token = logits.argmax(dim=-1, keepdim=True)
            history.append(token)
            if pos == context:
                # Slide: the last `keep` tokens again from position 0.
                recent = torch.cat(history, dim=1)[:, -keep:]
                history = [recent]
                logits = model(recent, caches, 0)
                pos = keep
            else:
                logits = model(token, caches, pos)
                pos += 1
            steps.append(time.perf_counter() - t0)
        seconds = time.perf_counter() - start
    steps.sort()
    at = lambda q: steps[round((len(steps) - 1) * q)] * 1e6
    print(json.dumps({
        "tokens_per_sec": a.tokens * a.streams / seconds,
        "token_us_p50": at(0.5),
        "token_us_p99": at(0.99),
        "streams": a.streams,
        "threads": a.threads,
        "rss_bytes": rss(),
        "torch": torch.__version__,
    }))


if __name__ == "__main__":
    main()
