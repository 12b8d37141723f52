"""MFU's values against hand counts: FLOPs of an MLP and of a 2-layer transformer counted over the
run's first step (within 5 % of the textbook count), tokens per second, mfu from a given peak, mfu
left out on the CPU with one warning; the peak table; no host read."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import batchtap as bt
from batchtap.errors import ConfigError
from batchtap.hostreads import HostReadCounter
from batchtap.metrics.throughput import peak_flops_of
from tests.conftest import ListSink


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(self.ln1(x)).split(d, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 96, d: int = 48, heads: int = 4, layers: int = 2, block: int = 32) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(block, d))
        self.blocks = nn.ModuleList([_Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _run(
    sink: ListSink,
    model: nn.Module,
    batches: list,
    metric: bt.metrics.MFU,
    *,
    tokens: bool = False,
    reads: HostReadCounter | None = None,
) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tap = bt.Tap([bt.metrics.Loss(), bt.metrics.StepTime(), metric], [sink], flush_every=2)
    with tap, tap.run(name="mfu"):
        for i, (x, y) in enumerate(batches):
            opt.zero_grad(set_to_none=True)
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            loss.backward()
            opt.step()
            if reads is None or i == 0:  # the run's first step allocates the ring's host views
                tap.step(loss=loss, targets=y if tokens else None, batch_size=x.shape[0])
                continue
            with reads:  # the step call alone: the optimizer itself reads its step count
                tap.step(loss=loss, targets=y if tokens else None, batch_size=x.shape[0])


def _counted(sink: ListSink) -> list[float]:
    """FLOPs per step as recorded: flops_per_second x step_time."""
    return [
        r.values["flops_per_second"] * r.values["step_time"] for r in sink.records if "flops_per_second" in r.values
    ]


def test_mlp_flops_within_5_percent_of_the_hand_count(sink: ListSink) -> None:
    torch.manual_seed(0)
    sizes = [(64, 256), (256, 256), (256, 10)]
    model = nn.Sequential(nn.Linear(*sizes[0]), nn.ReLU(), nn.Linear(*sizes[1]), nn.ReLU(), nn.Linear(*sizes[2]))
    b = 32
    batches = [(torch.randn(b, 64), torch.randint(0, 10, (b,))) for _ in range(5)]
    _run(sink, model, batches, bt.metrics.MFU())
    # forward 2*b*in*out per layer; backward the weight gradient the same, the input gradient the
    # same except for the first layer (its input needs none)
    hand = sum(4 * b * i * o for i, o in sizes) + sum(2 * b * i * o for i, o in sizes[1:])
    counted = _counted(sink)
    assert len(counted) == 4  # every step after the first, the counted one
    for value in counted:
        assert value == pytest.approx(hand, rel=0.05)
    assert "flops_per_second" not in sink.records[0].values  # not known before the count
    assert all("mfu" not in r.values for r in sink.records)
    warnings = [e for e in sink.events if e.kind is bt.EventKind.WARNING]
    assert len(warnings) == 1 and "mfu: left out on the CPU" in warnings[0].message


def test_two_layer_transformer_flops_and_tokens_per_second(sink: ListSink) -> None:
    torch.manual_seed(1)
    vocab, d, layers, b, t = 96, 48, 2, 4, 32
    model = TinyGPT(vocab, d, 4, layers, t)
    batches = [(torch.randint(0, vocab, (b, t)), torch.randint(0, vocab, (b, t))) for _ in range(4)]
    _run(sink, model, batches, bt.metrics.MFU(peak_flops=1e12), tokens=True)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    # the textbook count (PaLM appendix B, nanoGPT's estimate_mfu): 6 N per token for the matrix
    # products, 12 L T d per token for attention
    hand = 6 * linear * b * t + 12 * layers * t * d * b * t
    counted = _counted(sink)
    assert len(counted) == 3
    for value in counted:
        assert value == pytest.approx(hand, rel=0.05)
    timed = [r for r in sink.records if "step_time" in r.values]  # the first step has no start mark
    assert len(timed) == 3
    for r in timed:
        assert r.values["tokens_per_second"] == pytest.approx(b * t / r.values["step_time"], rel=1e-9)
        if "flops_per_second" in r.values:
            assert r.values["mfu"] == pytest.approx(r.values["flops_per_second"] / 1e12, rel=1e-9)
    assert not [e for e in sink.events if e.kind is bt.EventKind.WARNING]


def test_given_flops_per_step_and_no_host_read(sink: ListSink) -> None:
    torch.manual_seed(2)
    model = nn.Linear(16, 4)
    batches = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(6)]
    reads = HostReadCounter()
    _run(sink, model, batches, bt.metrics.MFU(flops_per_step=1234.0), tokens=True, reads=reads)
    assert reads.count == 0, reads.reads
    timed = [r for r in sink.records if "step_time" in r.values]
    assert len(timed) == 5
    for r in timed:
        assert r.values["flops_per_second"] * r.values["step_time"] == pytest.approx(1234.0, rel=1e-9)
        assert "tokens_per_second" not in r.values  # class targets of one dimension: not tokens


def test_peak_table_and_bad_arguments() -> None:
    assert peak_flops_of("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.4e12
    assert peak_flops_of("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert peak_flops_of("NVIDIA H200", torch.float16) == 989.4e12
    assert peak_flops_of("NVIDIA A100-SXM4-80GB", torch.float32) == 19.5e12
    assert peak_flops_of("NVIDIA A100-SXM4-80GB", torch.float32, tf32=True) == 156e12
    assert peak_flops_of("NVIDIA GeForce GTX 1080", torch.bfloat16) is None
    assert peak_flops_of("NVIDIA H100", torch.int8) is None
    with pytest.raises(ConfigError, match="peak_flops must be a positive finite number or None, got 0"):
        bt.metrics.MFU(peak_flops=0)
    with pytest.raises(ConfigError, match="flops_per_step must be a positive finite number or None, got nan"):
        bt.metrics.MFU(flops_per_step=math.nan)
    with pytest.raises(ConfigError, match="dtype must be a torch.dtype"):
        bt.metrics.MFU(dtype="bf16")  # type: ignore[arg-type]
