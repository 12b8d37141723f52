"""A planted-sync copy of nanoGPT's ``train.py`` loop, cut down to run in seconds on a CPU.

Kept from nanoGPT: the uint16 token file read through ``np.memmap`` and indexed with tensor
indices, ``x.to(device)`` in ``get_batch``, the causal-mask buffer, ``pos`` made with
``device=device``, AdamW from ``configure_optimizers`` (CPU step counters), gradient accumulation
through a disabled ``GradScaler``, ``clip_grad_norm_``, ``get_lr`` and ``estimate_loss``.

Every line that syncs on a GPU ends with a ``SYNC`` comment: nanoGPT's own two ``loss.item()`` lines, and
two planted ones. ``batchtap audit`` must list exactly these. Usage: ``nanogpt_planted.py OUT_DIR``.
"""

import math
import os
import sys
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

out_dir = sys.argv[1]
block_size, batch_size, vocab_size, n_embd, n_head = 8, 4, 32, 16, 2
max_iters, eval_interval, eval_iters, log_interval = 8, 4, 2, 2
gradient_accumulation_steps, grad_clip = 2, 1.0
learning_rate, min_lr, warmup_iters, lr_decay_iters = 1e-3, 1e-4, 2, 8
device = "cuda" if torch.cuda.is_available() else "cpu"
device_type = "cuda" if "cuda" in device else "cpu"
ctx = nullcontext() if device_type == "cpu" else torch.amp.autocast(device_type=device_type, dtype=torch.bfloat16)
torch.manual_seed(1337)

data_path = os.path.join(out_dir, "train.bin")
np.random.default_rng(0).integers(0, vocab_size, 4000).astype(np.uint16).tofile(data_path)


def get_batch(split):
    data = np.memmap(data_path, dtype=np.uint16, mode="r")
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy((data[i : i + block_size]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i + 1 : i + 1 + block_size]).astype(np.int64)) for i in ix])
    if device_type == "cuda":
        x, y = x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    else:
        x, y = x.to(device), y.to(device)
    return x, y


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(n_embd, dim=2)
        k = k.view(B, T, n_head, C // n_head).transpose(1, 2)
        q = q.view(B, T, n_head, C // n_head).transpose(1, 2)
        v = v.view(B, T, n_head, C // n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.attn = CausalSelfAttention()
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        x = self.wte(idx) + self.wpe(pos)
        x = self.ln_f(x + self.attn(x))
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == "cuda")


model = GPT()
model.to(device)
scaler = torch.amp.GradScaler(device_type, enabled=False)
optimizer = model.configure_optimizers(0.1, learning_rate, (0.9, 0.95), device_type)


@torch.no_grad()
def estimate_loss():
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split)
            with ctx:
                logits, loss = model(X, Y)
            losses[k] = loss.item()  # SYNC
        out[split] = losses.mean()
    model.train()
    return out


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (learning_rate - min_lr)


iter_num, best_val_loss = 0, 1e9
X, Y = get_batch("train")
while True:
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    if iter_num % eval_interval == 0:
        losses = estimate_loss()
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if losses["val"] < best_val_loss:
            best_val_loss = losses["val"]
    for micro_step in range(gradient_accumulation_steps):
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        if not torch.isfinite(loss):  # SYNC
            raise RuntimeError("loss is not finite")
        X, Y = get_batch("train")
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if iter_num % log_interval == 0:
        lossf = loss.item() * gradient_accumulation_steps  # SYNC
        print(f"iter {iter_num}: loss {lossf:.4f}, lr {lr:.2e}, grad norm {norm.tolist():.3f}")  # SYNC
    iter_num += 1
    if iter_num > max_iters:
        break
print("done", iter_num)
