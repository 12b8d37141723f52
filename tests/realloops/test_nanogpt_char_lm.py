"""A nanoGPT-style character LM loop, the way ``train.py`` writes it: padded targets (-100),
``[B, T, V]`` logits, 4-step gradient accumulation with ``(loss / 4).backward()``, bf16 autocast,
``clip_grad_norm_``, AdamW with nanoGPT's warm-up + cosine ``get_lr`` set by hand every iteration,
``zero_grad(set_to_none=True)`` and a periodic ``estimate_loss()``.

Every stored value is compared, step by step, with what ``.item()`` says in the same loop.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import batchtap as bt
from batchtap.hostreads import HostReadCounter
from tests.conftest import ListSink
from tests.realloops._loops import (
    F32_REL,
    assert_clean,
    assert_one_record_per_step,
    sparse_records,
)


@dataclass
class Config:
    vocab_size: int = 24
    block_size: int = 8
    n_embd: int = 16
    n_head: int = 2
    max_iters: int = 8
    accum: int = 4
    micro_batch_sizes: tuple[int, ...] = (4, 3, 5, 4)  # uneven on purpose: the loss is sample-weighted
    learning_rate: float = 1e-2
    min_lr: float = 1e-3
    warmup_iters: int = 2
    lr_decay_iters: int = 8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_interval: int = 3
    eval_iters: int = 2


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.n_embd, 4 * cfg.n_embd), nn.GELU(), nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.block = Block(cfg)
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as nanoGPT

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        return self.lm_head(self.ln_f(self.block(x)))  # [B, T, V]


def configure_optimizers(model: nn.Module, cfg: Config) -> torch.optim.AdamW:
    """nanoGPT's two groups: weight decay on matrices, none on biases and norms (same lr)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=cfg.learning_rate,
        betas=(0.9, 0.95),
    )


def get_lr(it: int, cfg: Config) -> float:
    """nanoGPT's schedule: linear warm-up, then cosine decay to min_lr."""
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > cfg.lr_decay_iters:
        return cfg.min_lr
    ratio = (it - cfg.warmup_iters) / (cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.learning_rate - cfg.min_lr)


PAD = 0


def make_get_batch(cfg: Config):
    g = torch.Generator().manual_seed(7)
    data = {  # token 0 is the padding id
        "train": torch.randint(1, cfg.vocab_size, (3000,), generator=g),
        "val": torch.randint(1, cfg.vocab_size, (600,), generator=g),
    }

    def get_batch(split: str, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        d = data[split]
        ix = torch.randint(len(d) - cfg.block_size - 1, (batch_size,), generator=g)
        x = torch.stack([d[i : i + cfg.block_size] for i in ix])
        y = torch.stack([d[i + 1 : i + 1 + cfg.block_size] for i in ix])
        # documents shorter than the block: pad the input, ignore those targets (as HF collators do)
        lengths = torch.randint(cfg.block_size // 2, cfg.block_size + 1, (batch_size,), generator=g)
        pad = torch.arange(cfg.block_size) >= lengths[:, None]
        x[pad] = PAD
        y[pad] = -100
        return x, y

    return get_batch


def test_nanogpt_char_lm_every_value_equals_item(sink: ListSink) -> None:
    cfg = Config()
    torch.manual_seed(0)
    model = GPT(cfg)
    optimizer = configure_optimizers(model, cfg)
    get_batch = make_get_batch(cfg)
    V = cfg.vocab_size

    @torch.no_grad()
    def estimate_loss() -> torch.Tensor:
        model.eval()
        losses = torch.zeros(cfg.eval_iters)
        for k in range(cfg.eval_iters):
            x, y = get_batch("val", 4)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x)
                losses[k] = F.cross_entropy(logits.view(-1, V), y.view(-1), ignore_index=-100)
        model.train()
        return losses.mean()

    counters: list[HostReadCounter] = []

    def counted(it: int) -> contextlib.AbstractContextManager:
        # the run's first step allocates the ring and its host views (once per run): not counted
        if it == 0:
            return contextlib.nullcontext()
        counters.append(HostReadCounter())
        return counters[-1]

    expected: list[dict[str, float]] = []
    logged: list[tuple[int, float]] = []
    discriminating = 0  # steps where the sample-weighted mean differs from the plain mean of micro losses
    tap = bt.Tap(optimizer=optimizer, sinks=[sink], flush_every=3)
    with tap, tap.run(name="char-lm", config=asdict(cfg)):
        for it in range(cfg.max_iters):
            lr = get_lr(it, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            weighted, samples, correct, kept, tokens, micro_losses = 0.0, 0, 0, 0, 0, []
            for micro in range(cfg.accum):
                x, y = get_batch("train", cfg.micro_batch_sizes[micro])
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(x)
                    loss = F.cross_entropy(logits.view(-1, V), y.view(-1), ignore_index=-100)
                with counted(it):
                    tap.accumulate(loss=loss, outputs=logits, targets=y, tokens=x.numel())
                (loss / cfg.accum).backward()
                # the reference, the ordinary way
                n = x.size(0)
                weighted += loss.item() * n
                samples += n
                micro_losses.append(loss.item())
                keep = y != -100
                pred = logits.float().argmax(-1)
                correct += ((pred == y) & keep).sum().item()
                kept += keep.sum().item()
                tokens += x.numel()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            with counted(it):
                tap.step(grad_norm=norm)
            expected.append(
                {
                    "loss": weighted / samples,
                    "accuracy": correct / kept,
                    "lr": lr,
                    "grad_norm": norm.item(),
                    "tokens": tokens,
                }
            )
            if abs(weighted / samples - sum(micro_losses) / len(micro_losses)) > 1e-4 * (weighted / samples):
                discriminating += 1
            assert kept < tokens  # padding was ignored at every step
            if it % cfg.eval_interval == 0:
                val = estimate_loss()
                with counted(it):
                    tap.log({"val_loss": val})
                logged.append((it, val.item()))

    assert sum(c.count for c in counters) == 0, [r for c in counters for r in c.reads]
    assert len(counters) == (cfg.max_iters - 1) * (cfg.accum + 1) + sum(1 for it, _ in logged if it > 0)
    assert discriminating >= cfg.max_iters // 2  # uneven micro-batches make the weighting matter

    rows = assert_one_record_per_step(sink.records, cfg.max_iters)
    assert_clean(sink.events)
    assert [r.status for r in sink.ended] == [bt.RunStatus.FINISHED]
    for record, ref in zip(rows, expected):
        values = record.values
        # a float32 weighted mean of float32 losses on the device vs the float64 mean of .item()s
        assert values["loss"] == pytest.approx(ref["loss"], rel=F32_REL), record.step
        # counts are exact integers: the fraction is the same division
        assert values["accuracy"] == pytest.approx(ref["accuracy"], rel=1e-12, abs=0), record.step
        # copies of host floats / of clip_grad_norm_'s float32 tensor: exact
        assert values["lr"] == ref["lr"], record.step
        assert values["grad_norm"] == ref["grad_norm"], record.step
        assert "lr_group1" not in values  # both AdamW groups carry the same lr
        assert not any(name.startswith("memory") or name == "data_time" for name in values)  # CPU, no loader
        if record.step >= 1:  # the run's first step has no measured start
            assert values["step_time"] > 0
            assert values["throughput"] == pytest.approx(ref["tokens"] / values["step_time"], rel=1e-9)
    assert {r.step for r in rows if "throughput" in r.values} >= set(range(1, cfg.max_iters))

    evals = sparse_records(sink.records)
    assert [(r.step, set(r.values)) for r in evals] == [(it, {"val_loss"}) for it, _ in logged]
    for record, (_, val) in zip(evals, logged):
        assert record.sparse is True
        assert record.values["val_loss"] == val  # a float32 tensor copied as it is
