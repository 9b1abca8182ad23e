"""The files of a search's out directory (deepnex.tune): the directory is
the user's own, and every file the search writes there (the journal, the
trials' logs, warm.log, results.csv, best.json, tune.png) is a new file of
mode 0600 that replaces whatever had the name, never writing through it.

Why: --out may name a directory that someone else prepared (a shared /tmp,
the default tune-results under it), with symlinks or hard links planted
under the names the search writes, which open(path, "w") would follow and
truncate; and the journal and logs hold the trials' configurations and
output, which other users have no business reading.
"""

import os
import secrets
import stat

from .errors import FailedPreconditionError, PermissionDeniedError


# Files and directories of a search are the user's alone.
FILE_MODE = 0o600
DIR_MODE = 0o700


def prepare_dir(path):
    """Creates `path` (mode 0700) where it is not there; refuses one that
    is a symlink, not a directory, or owned by another user, in which the
    search's files could be replaced or read by that user, or one under a
    directory another user could swap it out of (_check_ancestors); makes
    the user's own that others could open 0700."""
    _check_ancestors(path)
    try:
        os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    except FileExistsError:
        pass   # not a directory: said below
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise FailedPreconditionError(
            f"out_dir: {path} is a symlink (to {os.readlink(path)}); give the directory itself")
    if not stat.S_ISDIR(st.st_mode):
        raise FailedPreconditionError(f"out_dir: {path} exists and is not a directory")
    if st.st_uid != os.geteuid():
        raise PermissionDeniedError(
            f"out_dir: {path} belongs to user {st.st_uid}, not to this one ({os.geteuid()}); "
            "its owner could replace the search's files: choose another out_dir")
    if st.st_mode & 0o077:
        # One the user made open (mkdir -m 777) is the user's: closed, so
        # that no one else can rename files in from now on.
        os.chmod(path, DIR_MODE)


def _check_ancestors(path):
    """Refuses `path` when a directory above it is another user's (root's
    aside) or writable by anyone without /tmp's sticky bit: that user could
    move it away and put a directory of theirs in its place, into which the
    search would then write (probe). A group's shared directory passes."""
    me = os.geteuid()
    parent = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    while not os.path.exists(parent):  # made below, 0700
        parent = os.path.dirname(parent)
    while True:
        st = os.stat(parent)
        if st.st_uid not in (0, me):
            raise PermissionDeniedError(
                f"out_dir: {path} is in {parent}, which belongs to user {st.st_uid}, who "
                "could put a directory of theirs in its place: choose another out_dir")
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise PermissionDeniedError(
                f"out_dir: {path} is in {parent} (mode {stat.S_IMODE(st.st_mode):o}), which "
                "anyone may write without the sticky bit /tmp has: anyone could put a "
                "directory of theirs in its place: choose another out_dir")
        if parent == "/":
            return
        parent = os.path.dirname(parent)


def _create_beside(path):
    """A new file (fd, its path) in path's directory, mode 0600. O_EXCL with
    O_CREAT never follows a symlink; O_NOFOLLOW says so twice."""
    directory, name = os.path.split(path)
    while True:
        temp = os.path.join(directory, f".{name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, FILE_MODE)
            return fd, temp
        except FileExistsError:
            continue


def open_new(path, mode="w", **kwargs):
    """A new, empty file at `path` open for writing (open()'s `mode` "w" or
    "wb"), put in place at once (a log can be followed while it grows): what
    had the name before, a symlink included, is replaced, not written
    through."""
    fd, temp = _create_beside(path)
    try:
        os.rename(temp, path)
    except BaseException:
        os.close(fd)
        os.unlink(temp)
        raise
    return os.fdopen(fd, mode, **kwargs)


def write_new(path, data, mode="w", **kwargs):
    """Replaces the file at `path` by one holding `data` (a str, or bytes
    with mode "wb") in one step: a reader sees the old file or the whole new
    one, and a symlink there is replaced, not followed."""
    fd, temp = _create_beside(path)
    try:
        with os.fdopen(fd, mode, **kwargs) as f:
            f.write(data)
        os.rename(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise
