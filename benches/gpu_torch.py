#!/usr/bin/env python3
"""The PyTorch side of the GPU comparison (benches/README.md, "CUDA"): the digits MLP
(64 → 128 → 64 → 10, batch 32, Adam 1e-3) and the GPT of `train_gpt` (4 layers, 4 heads,
width 128, context 64, batch 12, AdamW 1e-3 with weight decay 0.1 on the matrices),
trained eagerly on GPU 0 on random data of the same shapes (memory and time do not
depend on the values).

    python3 benches/gpu_torch.py [--iters 100]

Prints one JSON object: the GPU's name and, per model, `step_ms_median` (steps after the
first 10, each synchronised), `max_memory_reserved` and `max_memory_allocated` (bytes,
`torch.cuda`, over the whole run, the parameters and optimizer state included).
`workspace-cuda/gpu-check.sh run` runs it next to carve's `--device cuda` runs.
"""
import argparse
import json
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpt_torch import GPT  # the same model as the CPU comparison


def measure(model, opt, batch, iters):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        x, y = batch()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    steady = sorted(times[10:] or times)
    return {
        "step_ms_median": 1e3 * steady[len(steady) // 2],
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "params": sum(p.numel() for p in model.parameters()),
        "final_loss": float(loss),
    }


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=100)
    args = p.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    out = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda}

    mlp = Mlp().to(dev)
    opt = torch.optim.Adam(mlp.parameters(), lr=1e-3)
    digits = lambda: (torch.randn(32, 64, device=dev), torch.randint(0, 10, (32,), device=dev))
    out["mlp"] = measure(mlp, opt, digits, args.iters)
    del mlp, opt
    torch.cuda.empty_cache()

    vocab, context, batch = 65, 64, 12
    gpt = GPT(vocab, 128, 4, 4, context).to(dev)
    decay = [p for p in gpt.parameters() if p.dim() >= 2]
    no_decay = [p for p in gpt.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-3, betas=(0.9, 0.99)
    )
    tokens = lambda: (
        torch.randint(0, vocab, (batch, context), device=dev),
        torch.randint(0, vocab, (batch, context), device=dev),
    )
    out["gpt"] = measure(gpt, opt, tokens, args.iters)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
