"""Reading a flushed block back on the host, once the device has finished its copy.

Runs beside training (the pipeline thread, or the process pipeline's forwarder): it polls the
block's marker (a non-blocking query, between short sleeps that leave the GIL to the training
thread), then copies the rows out of the pinned buffer and host arrays, and releases their slots.
"""

from __future__ import annotations

import time

import numpy as np

from batchtap.capture.clock import DeviceGate
from batchtap.capture.flush import Block, BlockData, Flusher

__all__ = ["read_block"]

_OPEN = DeviceGate()  # a gate nobody pauses


def read_block(flusher: Flusher, block: Block, gate: DeviceGate | None = None) -> BlockData:
    """Wait until ``block``'s copy completed, read its rows, and release their slots.

    Every device query runs inside ``gate`` (see :class:`DeviceGate`). The slots are released even
    when reading fails, or the training thread would wait for them forever.
    """
    gate = gate or _OPEN
    try:
        clock, ring = flusher.clock, flusher.ring
        while True:
            with gate.querying():
                if clock.marker_done(block.marker):
                    break
            time.sleep(flusher.poll_interval)  # polling keeps the GIL free for the training thread
        slots = ring.slots(block.first_row, block.last_row)
        with gate.querying():
            step_time = np.array(clock.take_elapsed(slots.tolist()), dtype=np.float64)
        host_values, facts = ring.read_host(block.first_row, block.last_row)
        return BlockData(
            device_values=ring.pinned_np[slots].astype(np.float64),
            host_values=host_values,
            step_time=step_time,
            **facts,
        )
    finally:
        flusher.release(block)
