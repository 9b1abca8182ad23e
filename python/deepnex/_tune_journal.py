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

import errno
import fcntl
import json
import os
import threading
import time

from . import _tune_files
from .errors import (AlreadyExistsError, DataLossError, FailedPreconditionError,
                     PermissionDeniedError)

JOURNAL = "journal.jsonl"


def read(path):
    """The records of the journal at `path` and the byte length of its
    whole lines (what is kept of it)."""
    with open(path, "rb") as f:
        return _parse(f.read(), path)


def _parse(data, path):
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
    threads write their own reports and ends. The search that holds it
    holds the journal's lock (flock) until close(): a second driver on the
    same out_dir, which would run every trial again and interleave its
    records with the first's, is refused."""

    def __init__(self, path, resume=False):
        """A new journal at `path` (AlreadyExistsError if one is there), or
        for `resume`, the one there, whose records are read into
        self.records and continued after (its torn tail cut off)."""
        self.path = path
        self._lock = threading.Lock()
        # Mode 0600: the journal holds the search's command line and
        # configurations. O_NOFOLLOW: a symlink planted under its name is
        # refused, never written through (O_EXCL refuses one already).
        flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags if resume else flags | os.O_CREAT | os.O_EXCL,
                         _tune_files.FILE_MODE)
        except FileExistsError:
            raise AlreadyExistsError(f"{path} exists: another search began there") from None
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise FailedPreconditionError(f"{path} is a symlink, not a search's journal") from None
        if resume:
            # Its records say what to run: another user's (planted where
            # they could write, as in an out dir left 0777) is refused.
            owner = os.fstat(fd).st_uid
            if owner != os.geteuid():
                os.close(fd)
                raise PermissionDeniedError(
                    f"{path} belongs to user {owner}, not to this one ({os.geteuid()}): "
                    "its commands are not resumed")
            os.fchmod(fd, _tune_files.FILE_MODE)   # one an older version made 0644
        self._file = os.fdopen(fd, "r+b")
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise FailedPreconditionError(
                f"{path}: another driver is running this search (it holds the journal's "
                "lock); wait for it to end, or stop it, before resuming") from None
        self.records = []
        if resume:
            try:
                self.records, keep = _parse(self._file.read(), path)
            except DataLossError:
                self._file.close()
                raise
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
