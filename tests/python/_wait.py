"""wait_for: how a test waits for something that happens in another thread
or process. It waits for the very condition it asserts next, with a generous
deadline, never on a sleep or on the order of output lines (on a loaded or a
fast machine both lie).

run_threads: how a test runs ranks or workers that wait for each other, one
thread each, and fails as the first of them failed."""

import threading
import time


def wait_for(condition, what, timeout=60.0, interval=0.02):
    """Polls condition() until it returns a true value, and returns that.

    After `timeout` seconds fails the test with "waited <timeout> s for
    <what>"; `what` is a string, or a callable giving one (to show the state
    at the deadline, e.g. a job's output so far).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"waited {timeout:g} s for {what() if callable(what) else what}")
        time.sleep(interval)


def run_threads(n, body, timeout=60.0, what="a thread"):
    """Runs body(i) for i in range(n), each on its own thread, joins them
    (failing with "<what> hung" after `timeout` seconds each) and re-raises
    the first failure by index."""
    errors = [None] * n

    def main(i):
        try:
            body(i)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors[i] = e

    threads = [threading.Thread(target=main, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), f"{what} hung"
    for e in errors:
        if e is not None:
            raise e
