"""`paused_gc` keeps the cyclic collector off while any pauser runs, resumes it when the last
ends, and leaves a collector the application disabled itself disabled."""

from __future__ import annotations

import gc
import threading

from eventbus.tier.gc_pause import paused_gc


def test_the_collector_resumes_when_the_last_of_two_threads_ends() -> None:
    assert gc.isenabled()
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with paused_gc():
            inside.set()
            leave.wait(10)

    thread = threading.Thread(target=other)
    with paused_gc():
        thread.start()
        assert inside.wait(10)
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread still pauses it
    leave.set()
    thread.join(10)
    assert gc.isenabled()


def test_a_collector_the_application_disabled_stays_disabled() -> None:
    gc.disable()
    try:
        with paused_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
