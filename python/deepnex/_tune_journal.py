"""The journal of a search (deepnex.tune): <out>/journal.jsonl, one JSON
record a line, appended and fsync'd as each event happens, so that a search
killed at any point (kill -9 included) can be resumed and shown.

Records, by "event":
  search  the search's arguments (the first record; a resume must match it)
  trial   a trial's configuration, when the search picked it
  start   an attempt of a trial began
  report  a report of an attempt and the scheduler's decision on it
  end     an attempt ended: its status and exit code
A last line without its newline is a record torn by a kill: it is dropped
(and cut off the file). Any other line that is not a record is an error
naming the file and the line's byte offset.
"""

import json
import os
import threading
import time

from .errors import DataLossError

JOURNAL = "journal.jsonl"


def read(path):
    """The records of the journal at `path` and the byte length of its
    whole lines (what is kept of it)."""
    with open(path, "rb") as f:
        data = f.read()
    records, offset = [], 0
    while offset < len(data):
        end = data.find(b"\n", offset)
        if end < 0:
            break   # a torn tail: the kill came mid-write
        try:
            record = json.loads(data[offset:end])
            if not isinstance(record, dict) or "event" not in record:
                raise ValueError("not a journal record")
        except ValueError as e:
            raise DataLossError(f"{path}: byte offset {offset}: damaged record ({e})") from None
        records.append(record)
        offset = end + 1
    return records, offset


class Journal:
    """Appends records to a search's journal. Thread-safe: the trials'
    threads write their own reports and ends."""

    def __init__(self, path, keep=None):
        """keep: the byte length of the whole records to continue after (a
        resume), or None for a new journal."""
        self.path = path
        self._lock = threading.Lock()
        if keep is None:
            self._file = open(path, "xb")
        else:
            self._file = open(path, "r+b")
            self._file.truncate(keep)
            self._file.seek(keep)

    def append(self, record):
        # "time": when it happened, for show and for timing a search.
        record = {**record, "time": round(time.time(), 3)}
        line = json.dumps(record, separators=(",", ":")).encode() + b"\n"
        with self._lock:
            if self._file.closed:
                return
            self._file.write(line)
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self):
        with self._lock:
            self._file.close()
