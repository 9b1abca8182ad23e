"""wait_for: how a test waits for something that happens in another thread
or process. It waits for the very condition it asserts next, with a generous
deadline, never on a sleep or on the order of output lines (on a loaded or a
fast machine both lie)."""

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
