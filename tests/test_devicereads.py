"""DeviceReadTracker: which tensors would live on the accelerator, and which host reads sync.

Every case runs on the CPU, where ``.to("cpu")`` is a no-op: the tracker must still tell a move to
the script's device from a copy back to the host, and host-only tensors from device ones.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from batchtap.devicereads import DeviceReadTracker

DEVICE = "cpu"  # what `device = "cuda" if torch.cuda.is_available() else "cpu"` gives here


def _ops(tracker: DeviceReadTracker) -> list[tuple[str, bool]]:
    return [(r.op, r.device) for r in tracker.reads]


def test_parameters_and_everything_computed_from_them_are_device_tensors() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    with DeviceReadTracker() as tracker:
        x = torch.randn(4, 3)
        out = layer(x)
        loss = out.pow(2).mean()
        loss.backward()
        assert tracker.is_device(layer.weight) and tracker.is_device(out) and tracker.is_device(loss)
        assert tracker.is_device(layer.weight.grad)  # made by backward from a device loss
        assert not tracker.is_device(x)
        x.sum().item()
        loss.item()
        out.tolist()
        x.tolist()
    assert _ops(tracker) == [
        ("item/float/bool", False),
        ("item/float/bool", True),
        ("Tensor.tolist", True),
        ("Tensor.tolist", False),
    ]


def test_a_move_to_the_device_is_a_new_device_tensor_and_the_host_original_stays_host() -> None:
    with DeviceReadTracker() as tracker:
        batch = torch.randn(5)
        moved = batch.to(DEVICE)
        moved_kw = batch.to(device=DEVICE, non_blocking=True)
        assert moved is not batch and torch.equal(moved, batch)
        assert tracker.is_device(moved) and tracker.is_device(moved_kw) and not tracker.is_device(batch)
        like = torch.randn(2).to(moved)  # .to(other): the other tensor's device
        assert tracker.is_device(like)
        assert not tracker.is_device(batch.to(torch.float64))  # a dtype change moves nothing
        assert tracker.is_device(moved.to(torch.float64))


def test_a_leaf_moved_to_the_device_stays_a_leaf_an_optimizer_accepts() -> None:
    with DeviceReadTracker() as tracker:
        w = torch.randn(3, requires_grad=True).to(DEVICE)
        assert w.is_leaf and tracker.is_device(w)
        opt = torch.optim.SGD([w], lr=0.1)
        w.pow(2).sum().backward()
        opt.step()
        assert w.grad is not None and tracker.is_device(w.grad)


def test_copies_to_the_host_are_reads_and_their_results_host_tensors() -> None:
    layer = torch.nn.Linear(2, 2)
    with DeviceReadTracker() as tracker:
        y = layer(torch.randn(3, 2)).detach()
        a = y.cpu()
        b = y.to("cpu")
        c = y.to(torch.device("cpu"))
        d = y.to("cpu", non_blocking=True)  # queued, not waited for
        assert not any(tracker.is_device(t) for t in (a, b, c, d))
        assert tracker.is_device(y)  # the source is still on the device
        a.numpy()  # the host copy: no second sync
        host = torch.zeros(3, 2)
        host.copy_(y)
        assert not tracker.is_device(host)  # copy_ does not move its destination
        host.copy_(y, non_blocking=True)
    assert _ops(tracker) == [("to(cpu)", True)] * 3 + [("Tensor.numpy", False), ("copy_ to host", True)]


def test_printing_a_device_tensor_is_one_read() -> None:
    layer = torch.nn.Linear(4, 3)
    with DeviceReadTracker() as tracker:
        text = repr(layer.weight)  # Parameter.__repr__, then torch's printing with modes disabled
        str(torch.arange(3))
    assert "Parameter containing" in text
    assert _ops(tracker) == [("print/repr", True), ("print/repr", False)]


def test_data_dependent_shapes_are_reads() -> None:
    with DeviceReadTracker() as tracker:
        y = torch.randint(0, 3, (8,)).to(DEVICE)
        y[y > 0]
        torch.nonzero(y)
        torch.unique(y)
        torch.masked_select(y, y > 1)
        torch.equal(y, y)
    assert _ops(tracker) == [
        ("boolean-mask index", True),
        ("nonzero", True),
        ("unique", True),
        ("masked_select", True),
        ("equal", True),
    ]


def test_adamw_step_counters_stay_on_the_host_and_its_moments_on_the_device() -> None:
    layer = torch.nn.Linear(3, 1)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1)
    with DeviceReadTracker() as tracker:
        layer(torch.randn(2, 3)).sum().backward()
        opt.step()
        state = opt.state[layer.weight]
        assert not tracker.is_device(state["step"])
        assert tracker.is_device(state["exp_avg"]) and tracker.is_device(state["exp_avg_sq"])
    assert tracker.reads and not tracker.device_reads  # its step counter reads only


def test_grad_scaler_found_inf_written_in_place_becomes_a_device_tensor() -> None:
    layer = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    with DeviceReadTracker() as tracker:
        scaler.scale(layer(torch.randn(4, 3)).pow(2).mean()).backward()
        scaler.step(opt)  # reads found_inf: a sync on a GPU
        scaler.update()
    assert ("item/float/bool", True) in _ops(tracker)


def test_factories_on_a_line_naming_a_device_make_device_tensors() -> None:
    with DeviceReadTracker() as tracker:
        on_device = torch.zeros(3, device=DEVICE)
        on_host = torch.zeros(3, device="cpu")
        plain = torch.zeros(3)
        from_data = torch.tensor([1.0, 2.0], device=DEVICE)
        assert tracker.is_device(on_device) and tracker.is_device(from_data)
        assert not tracker.is_device(on_host) and not tracker.is_device(plain)


def test_module_to_device_moves_its_buffers_and_module_cpu_keeps_its_parameters() -> None:
    model = torch.nn.BatchNorm1d(3)
    weight = model.weight
    with DeviceReadTracker() as tracker:
        assert not tracker.is_device(model.running_mean)
        model.to(DEVICE)
        assert tracker.is_device(model.running_mean) and model.weight is weight
        out = model(torch.randn(4, 3))
        assert tracker.is_device(out)
        model.cpu()  # on a GPU: one copy per tensor to the host
        assert model.weight is weight and model.weight.data_ptr() == weight.data_ptr()
    assert ("to(cpu)", True) in _ops(tracker)


def test_data_of_a_parameter_is_a_device_tensor() -> None:
    layer = torch.nn.Linear(2, 2)
    with DeviceReadTracker() as tracker:
        data = layer.weight.data
        assert tracker.is_device(data)
        layer.weight.data = torch.ones(2, 2)  # the setter still works
    assert torch.equal(layer.weight, torch.ones(2, 2))


def test_reads_are_attributed_to_this_file_with_the_library_line_under_them() -> None:
    with DeviceReadTracker() as tracker:
        y = torch.randn(6).to(DEVICE)
        np.asarray(y)
        F.cross_entropy(torch.randn(2, 3).to(DEVICE), torch.tensor([0, 1])).item()
    array, item = tracker.reads
    assert array.op == "Tensor.__array__" and array.device and array.user is not None
    assert array.user.filename == __file__ and "np.asarray(y)" in array.user.text
    assert item.user is not None and ".item()" in item.user.text and item.via is None


def test_only_the_entering_thread_is_recorded_and_everything_is_restored_after() -> None:
    originals = (torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy, torch.nn.Module.to)
    layer = torch.nn.Linear(2, 1)
    done = threading.Event()

    def elsewhere() -> None:
        layer(torch.randn(1, 2)).tolist()
        done.set()

    with DeviceReadTracker() as tracker:
        thread = threading.Thread(target=elsewhere)
        thread.start()
        assert done.wait(30)
        thread.join()
    assert tracker.reads == []
    assert (torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy, torch.nn.Module.to) == originals
    assert "data" not in torch.Tensor.__dict__
    x = torch.randn(2)
    assert x.to("cpu") is x  # plain torch again


def test_bad_to_arguments_keep_torch_errors() -> None:
    with DeviceReadTracker(), pytest.raises((TypeError, RuntimeError)):
        torch.randn(2).to("no-such-device")
