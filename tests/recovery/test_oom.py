"""split_on_oom on CPU: a loss function that raises out-of-memory above a size stands in for the GPU."""

from __future__ import annotations

import pytest
import torch

from batchtap.errors import ConfigError, InputError
from batchtap.recovery import AdaptiveBatchSampler, is_oom_error, split_on_oom


class Budget:
    """A model whose forward (or backward) 'runs out of memory' above ``limit`` samples."""

    def __init__(self, limit: int, *, where: str = "forward", error: type[BaseException] = torch.OutOfMemoryError):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 1))
        self.limit, self.where, self.error = limit, where, error
        self.sizes: list[int] = []

    def loss_fn(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.sizes.append(x.shape[0])
        too_big = x.shape[0] > self.limit
        if too_big and self.where == "forward":
            raise self.error("CUDA out of memory. Tried to allocate 2.00 GiB")
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        if too_big:  # "backward" OOM: half the gradients already landed when it fails
            out = loss
            out.backward(retain_graph=True)

            class Fail(torch.autograd.Function):
                @staticmethod
                def forward(ctx, t):
                    return t.clone()

                @staticmethod
                def backward(ctx, g):
                    raise self.error("CUDA out of memory (backward)")

            return Fail.apply(loss)
        return loss

    def grads(self) -> list[torch.Tensor]:
        return [p.grad.clone() for p in self.model.parameters()]


def _batch(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g), torch.randn(n, 1, generator=g)


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize(("n", "limit", "chunk"), [(16, 5, 4), (10, 4, 3), (7, 1, 1)])
def test_split_gradient_matches_the_full_batch(n, limit, chunk, where):
    x, y = _batch(n, seed=n * 31 + limit)
    ref = Budget(limit=10**9)
    ref_loss = ref.loss_fn(x, y)
    ref_loss.backward()

    b = Budget(limit=limit, where=where)
    r = split_on_oom(b.loss_fn, x, y, zero_grad=b.model.zero_grad)

    assert r.chunk_size == chunk and r.retries >= 1 and r.chunks == -(-n // chunk)
    torch.testing.assert_close(r.loss, ref_loss.detach())
    for got, want in zip(b.grads(), ref.grads()):
        torch.testing.assert_close(got, want)


def test_no_error_means_one_pass_and_no_resize():
    b = Budget(limit=100)
    s = AdaptiveBatchSampler(range(100), 8)
    r = split_on_oom(b.loss_fn, *_batch(8, 1), zero_grad=b.model.zero_grad, sampler=s)
    assert (r.chunk_size, r.chunks, r.retries, b.sizes, s.batch_size) == (8, 1, 0, [8], 8)


def test_the_sampler_is_lowered_to_the_chunk_that_fit():
    b = Budget(limit=6)
    s = AdaptiveBatchSampler(range(100), 32, min_size=2, max_size=64)
    split_on_oom(b.loss_fn, *_batch(32, 2), zero_grad=b.model.zero_grad, sampler=s)
    assert s.batch_size == 4  # 32 -> 16 -> 8 -> 4


def test_a_generic_runtime_error_saying_out_of_memory_is_caught():
    b = Budget(limit=3, error=RuntimeError)
    assert split_on_oom(b.loss_fn, *_batch(8, 3), zero_grad=b.model.zero_grad).chunk_size == 2


def test_other_errors_propagate_untouched():
    def boom(x, y):
        raise RuntimeError("shape mismatch")

    with pytest.raises(RuntimeError, match="shape mismatch"):
        split_on_oom(boom, *_batch(4, 4), zero_grad=lambda: None)


def test_oom_at_min_chunk_is_re_raised():
    b = Budget(limit=0)
    with pytest.raises(torch.OutOfMemoryError):
        split_on_oom(b.loss_fn, *_batch(8, 5), zero_grad=b.model.zero_grad, min_chunk=2)
    assert b.sizes == [8, 4, 2]


def test_nested_inputs_are_split_together():
    torch.manual_seed(1)
    seen = []

    def loss_fn(inputs, targets):
        seen.append((inputs["a"].shape[0], inputs["b"][0].shape[0], targets.shape[0]))
        if inputs["a"].shape[0] > 2:
            raise torch.OutOfMemoryError("out of memory")
        w = torch.ones(3, requires_grad=True)
        return (inputs["a"] @ w + inputs["b"][0].sum(1) - targets).pow(2).mean()

    g = torch.Generator().manual_seed(2)
    inputs = {"a": torch.randn(5, 3, generator=g), "b": (torch.randn(5, 2, generator=g),)}
    split_on_oom(loss_fn, inputs, torch.randn(5, generator=g), zero_grad=lambda: None)
    assert seen == [(5, 5, 5), (3, 3, 3), (2, 2, 2), (2, 2, 2), (1, 1, 1)]


def test_bad_arguments():
    x, y = _batch(4, 6)
    with pytest.raises(InputError, match="4 vs 3"):
        split_on_oom(lambda a, b: a.sum(), x, y[:3], zero_grad=lambda: None)
    with pytest.raises(ConfigError, match="min_chunk"):
        split_on_oom(lambda a, b: a.sum(), x, y, zero_grad=lambda: None, min_chunk=0)


def test_is_oom_error():
    assert is_oom_error(torch.OutOfMemoryError("x"))
    assert is_oom_error(RuntimeError("HIP out of memory"))
    assert not is_oom_error(RuntimeError("index out of range"))
    assert not is_oom_error(MemoryError())
