"""Handing a device tensor from one stream, thread or collective to another: the one rule.

On a GPU, "the future has completed" says only that the *host* side is done: the kernels that
write the tensor may still be queued on some stream (gloo's CUDA path copies back to the device
on its own stream; a callback runs on a stream from torch's pool; commopt's communication
thread runs on a side stream). Reading the tensor on another stream without an ordering
between the two reads whatever was there before. ``CUDA_LAUNCH_BLOCKING=1`` hides such a bug,
which is how the DDP hook's replicas diverged on CUDA before this module existed.

**The rule.** Every future that carries a device tensor is a CUDA-aware future
(:func:`device_future`), and every consumer orders its stream after it with ``wait()``:

1. A producer completes a future with ``set_result`` *on the stream that wrote the value*
   (the current stream where it runs; inside a future's callback torch makes that a stream
   already ordered after the parent's work). A CUDA-aware future records an event there.
2. A consumer calls ``fut.wait()`` (never ``value()`` alone outside a ``then``/done
   callback) on the stream that will read the tensor: ``wait()`` makes the current stream wait
   for that event, without blocking the host.
3. A job handed to another stream waits for an event recorded on the submitting stream first,
   and the submitting stream waits for the job's event before reading what it wrote
   (:class:`commopt.optim.comm_thread.CommThread`).
4. A tensor allocated on one stream and used by another is kept alive until that other stream
   is done with it: by ownership (staged buffers live from step to step), by ``record_stream``,
   or, for the collectives, by torch.distributed itself (it records its input tensors on its
   streams). MPI knows nothing of streams: :class:`~commopt.comm.MpiBackend` synchronizes the
   stream before handing device memory over, and its host staging is a blocking copy.

On CPU none of this costs anything: :func:`device_future` is a plain future there.
"""

from __future__ import annotations

import torch

__all__ = ["completed_future", "device_future"]


def device_future(device: torch.device) -> torch.futures.Future[torch.Tensor]:
    """A future to be completed with tensors on ``device``: CUDA-aware (``devices=[device]``)
    on a CUDA device, so that ``set_result`` records an event on the current stream and
    ``wait()`` orders the waiter's stream after it; a plain future elsewhere."""
    if device.type == "cuda":
        return torch.futures.Future(devices=[device])
    return torch.futures.Future()


def completed_future(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    """A future already completed with ``value``, written on the current stream."""
    fut = device_future(value.device)
    fut.set_result(value)
    return fut
