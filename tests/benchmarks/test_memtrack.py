"""benchmarks/_lib/memtrack.py: the device-independent peak of live tensor bytes during a call (exact on constructed
ops)."""

from __future__ import annotations

import gc

import torch

from benchmarks._lib.memtrack import TensorPeak, call_peak_bytes


def test_a_tensor_and_its_view_count_once_and_are_released():
    with TensorPeak() as peak:
        x = torch.zeros(1000)  # 4000 B
        view = x[100:200]
        view.add_(1)  # in place on a view: same storage
        del x, view
        gc.collect()
    assert peak.peak_bytes == 4000
    assert peak.live_bytes == 0


def test_peak_is_the_largest_live_total_not_the_sum_of_allocations():
    def steps(x):
        t = x * 2  # 4 n
        u = t.exp()  # 4 n, t still alive: 8 n
        del t
        return u.sum()  # u + 4 B

    x = torch.ones(500)
    peak, out = call_peak_bytes(steps, x)
    assert peak == 2 * 4 * 500
    assert abs(out.item() - 500 * torch.tensor(2.0).exp().item()) < 1e-2

    def sequential():
        for _ in range(3):
            a = torch.empty(256, dtype=torch.float64)  # 2048 B, freed before the next
            del a

    assert call_peak_bytes(sequential)[0] == 2048


def test_storages_alive_before_the_block_are_not_counted():
    x = torch.ones(1000)
    with TensorPeak() as peak:
        x.mul_(3)  # in place: no new storage
        x[:10].zero_()
        y = x.view(10, 100).t()  # views
        z = x + 1  # new: 4000 B
    assert peak.peak_bytes == 4000 and peak.live_bytes == 4000
    del y, z
    gc.collect()
    assert peak.live_bytes == 0


def test_dtypes_linear_python_data_and_resize():
    layer = torch.nn.Linear(16, 8).to(torch.bfloat16)
    inp = torch.randn(4, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        peak, out = call_peak_bytes(layer, inp)
    assert peak == 4 * 8 * 2  # the [4, 8] bf16 output only (weights existed before)
    assert call_peak_bytes(torch.tensor, [1.0, 2.0, 3.0])[0] == 12  # built outside the dispatcher
    with TensorPeak() as peak:
        buf = torch.empty(0)
        buf.resize_(100)  # re-measured when an op returns the resized storage
    assert peak.peak_bytes == 400
    del buf
