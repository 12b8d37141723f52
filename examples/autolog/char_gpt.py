"""A character-level GPT trained the way nanoGPT's train.py does it: ``get_batch`` from one long
token array, gradient accumulation with ``loss / gradient_accumulation_steps``, a warm-up + cosine
learning rate set by hand on every iteration, gradient clipping, ``ignore_index=-1`` padding, bf16
autocast. Synthetic text (no download). Record it unmodified with ``batchtap run char_gpt.py``.
"""

import argparse
import math
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--max_iters", type=int, default=30)
parser.add_argument("--gradient_accumulation_steps", type=int, default=4)
parser.add_argument("--batch_size", type=int, default=8)
parser.add_argument("--block_size", type=int, default=32)
parser.add_argument("--learning_rate", type=float, default=3e-3)
parser.add_argument("--min_lr", type=float, default=3e-4)
parser.add_argument("--warmup_iters", type=int, default=5)
parser.add_argument("--grad_clip", type=float, default=1.0)
parser.add_argument("--log_interval", type=int, default=1)
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
args = parser.parse_args()

torch.manual_seed(1337)
device = args.device
device_type = "cuda" if "cuda" in device else "cpu"
ctx = torch.autocast(device_type=device_type, dtype=torch.bfloat16) if device_type == "cuda" else nullcontext()

# the "dataset": a long synthetic text over 32 characters; -1 marks padded positions
text = "".join(chr(97 + (i * 7 + (i // 13) * 3) % 26) for i in range(20000))
chars = sorted(set(text))
stoi = {c: i for i, c in enumerate(chars)}
data = torch.tensor([stoi[c] for c in text], dtype=torch.long)
vocab_size = len(chars)


def get_batch():
    ix = torch.randint(len(data) - args.block_size - 1, (args.batch_size,))
    x = torch.stack([data[i : i + args.block_size] for i in ix])
    y = torch.stack([data[i + 1 : i + 1 + args.block_size] for i in ix])
    y[:, : args.block_size // 4] = -1  # the first positions of each row are context only
    if device_type == "cuda":  # pin arrays x,y, which allows us to move them to GPU asynchronously (non_blocking=True)
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = nn.MultiheadAttention(n_embd, n_head, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        T = x.size(1)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, n_embd=64, n_head=4, n_layer=2):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(args.block_size, n_embd)
        self.blocks = nn.Sequential(*[Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.blocks(self.wte(idx) + self.wpe(pos))
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss


def get_lr(it):
    if it < args.warmup_iters:
        return args.learning_rate * (it + 1) / (args.warmup_iters + 1)
    decay_ratio = (it - args.warmup_iters) / (args.max_iters - args.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return args.min_lr + coeff * (args.learning_rate - args.min_lr)


model = GPT().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, betas=(0.9, 0.95), weight_decay=0.1)

X, Y = get_batch()
for iter_num in range(args.max_iters):
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr
    total = torch.zeros((), device=device)
    for _micro_step in range(args.gradient_accumulation_steps):
        with ctx:
            logits, loss = model(X, Y)
            total += loss.detach()
            loss = loss / args.gradient_accumulation_steps
        X, Y = get_batch()
        loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if iter_num % args.log_interval == 0:
        lossf = total.item() / args.gradient_accumulation_steps  # note: a CPU-GPU sync point
        print(f"iter {iter_num}: loss {lossf:.6f}, lr {lr:.6e}, norm {norm.item():.6f}")
