"""CommThread: jobs run in ticket order, errors reach the main thread, CUDA jobs use a side stream.

The CUDA path runs without a GPU against a fake ``torch.cuda`` (streams and events that log what
is done to them); what it checks is the order of the calls, not that a device honours them.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from commopt.optim._early._thread import CommThread


def test_jobs_run_in_ticket_order_not_submission_order():
    thread = CommThread("test-comm")
    ran: list[int] = []
    first = thread.reserve(3)
    thread.submit(first + 2, lambda: ran.append(2))
    thread.submit(first + 1, lambda: ran.append(1))
    time.sleep(0.05)
    assert ran == []  # ticket 0 is still open: nothing may run before it
    thread.submit(first, lambda: ran.append(0))
    thread.wait_all()
    assert ran == [0, 1, 2]
    assert thread.idle
    thread.close()


def test_jobs_run_on_the_named_daemon_thread_and_skips_run_nothing():
    thread = CommThread("test-comm")
    names: list[str] = []
    first = thread.reserve(3)
    thread.skip(first)
    thread.submit(first + 1, lambda: names.append(threading.current_thread().name))
    thread.skip(first + 2)
    thread.wait_all()
    assert names == ["test-comm"]
    assert thread._thread is not None and thread._thread.daemon
    thread.close()
    assert not thread._thread.is_alive()  # joined


def test_skips_alone_start_no_thread():
    thread = CommThread()
    first = thread.reserve(2)
    thread.skip(first)
    thread.skip(first + 1)
    thread.wait_all()
    assert thread._thread is None


def test_error_cancels_later_jobs_and_is_raised_once_by_wait_all():
    thread = CommThread()
    ran, cancelled = [], []
    first = thread.reserve(3)
    thread.submit(first, lambda: (_ for _ in ()).throw(ValueError("boom")), cancelled.append)
    thread.submit(first + 1, lambda: ran.append(1), cancelled.append)
    thread.submit(first + 2, lambda: ran.append(2))
    with pytest.raises(ValueError, match="boom"):
        thread.wait(first + 2)  # wait() raises it too, without clearing it
    with pytest.raises(ValueError, match="boom"):
        thread.wait_all()
    assert ran == []
    assert [str(e) for e in cancelled] == ["boom", "boom"]  # the failed job and the next one
    second = thread.reserve(1)  # cleared: the thread goes on
    thread.submit(second, lambda: ran.append(3))
    thread.wait_all()
    assert ran == [3]
    thread.close()


def test_wait_all_refuses_a_ticket_never_filled():
    thread = CommThread()
    first = thread.reserve(2)
    thread.submit(first + 1, lambda: None)
    with pytest.raises(RuntimeError, match=r"tickets \[0\] were never submitted or skipped"):
        thread.wait_all()
    thread.skip(first)
    thread.wait_all()
    thread.close()


def test_a_ticket_cannot_be_filled_twice_or_outside_the_reservation():
    thread = CommThread()
    first = thread.reserve(1)
    thread.skip(first)
    with pytest.raises(RuntimeError, match="not open"):
        thread.skip(first)
    with pytest.raises(RuntimeError, match="not open"):
        thread.submit(first + 1, lambda: None)


def test_settle_stops_at_an_open_ticket():
    thread = CommThread()
    ran: list[int] = []
    first = thread.reserve(3)
    thread.submit(first, lambda: ran.append(0))
    thread.submit(first + 2, lambda: ran.append(2))
    thread.settle()  # returns although ticket 2 cannot run yet
    assert ran == [0]
    thread.skip(first + 1)
    thread.wait_all()
    assert ran == [0, 2]
    thread.close()


def test_close_is_idempotent_and_stops_an_idle_thread():
    thread = CommThread()
    t = thread.reserve(1)
    thread.submit(t, lambda: None)
    thread.wait_all()
    thread.close()
    thread.close()
    assert not thread._thread.is_alive()


def test_optimizer_finalizer_stops_its_thread():
    import gc

    import commopt

    w = torch.nn.Parameter(torch.ones(4))
    opt = commopt.OnebitAdam([w], freeze_step=1, overlap=True)
    for _ in range(2):
        opt.zero_grad()
        (w**2).sum().backward()
        opt.step()
    os_thread = opt.early_work.thread._thread
    assert os_thread is not None and os_thread.is_alive()
    del opt
    gc.collect()
    os_thread.join(5)
    assert not os_thread.is_alive()


# -- CUDA: a side stream and events, checked against a fake torch.cuda --------------------------
class _FakeCuda:
    """Streams and events that log what is done to them (no device involved)."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self._current = "main"
        fake = self

        class Event:
            count = 0

            def __init__(self) -> None:
                Event.count += 1
                self.name = f"e{Event.count}"

            def record(self, stream: Any) -> None:
                fake.log.append(f"{self.name}.record({stream.name})")

        class Stream:
            def __init__(self, device: Any = None, name: str = "side") -> None:
                self.name = name

            def wait_event(self, event: Any) -> None:
                fake.log.append(f"{self.name}.wait({event.name})")

        self.Event, self.Stream = Event, Stream

    def current_stream(self, device: Any = None) -> Any:
        return self.Stream(name=self._current)

    def stream(self, s: Any) -> Any:
        fake = self

        class Ctx:
            def __enter__(self) -> None:
                fake.saved, fake._current = fake._current, s.name

            def __exit__(self, *exc: object) -> None:
                fake._current = fake.saved

        return Ctx()


def test_cuda_job_runs_on_a_side_stream_between_events():
    cuda = _FakeCuda()
    thread = CommThread(cuda=cuda)
    first = thread.reserve(2)
    device = torch.device("cuda", 0)
    thread.submit(first, lambda: cuda.log.append(f"exchange on {cuda._current}"), device=device)
    thread.submit(first + 1, lambda: cuda.log.append("cpu job"), device=torch.device("cpu"))
    thread.wait_all()
    assert cuda.log == [
        "e1.record(main)",  # at submission: after the fold queued on the current stream
        "side.wait(e1)",  # the side stream waits for the fold ...
        "exchange on side",  # ... the exchange is queued on the side stream ...
        "e2.record(side)",  # ... and marks its end
        "cpu job",  # a CPU job touches no stream
        "main.wait(e2)",  # wait_all: the update on the current stream waits for the exchange
    ]
    thread.close()


def test_cpu_jobs_never_touch_cuda():
    class Refuse:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"torch.cuda.{name} used on CPU")

    thread = CommThread(cuda=Refuse())
    first = thread.reserve(1)
    thread.submit(first, lambda: None, device=torch.device("cpu"))
    thread.wait_all()
    thread.close()
