"""Printing progress to a stdout its reader may close (``chunkscan repro | head -1``)."""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO


def say(text: str) -> None:
    """Print ``text`` to stdout, flushed; once the reader has closed it (``| head``),
    stdout goes to ``os.devnull`` and the run goes on: the next line raised
    ``BrokenPipeError`` and the run was lost (``chunkscan repro``: every configuration
    measured, ``repro.json`` unwritten; ``chunkscan lora``: the training, at its banner;
    found by probing, sessions 49 and 50). Later writes to stdout, a library's too, go
    to ``os.devnull``. Inside :func:`guarded_stdout` the guard does this."""
    try:
        print(text, flush=True)
    except OSError as e:
        if not _reader_gone(e):
            raise
        _to_devnull(sys.stdout)


def _reader_gone(e: OSError) -> bool:
    """``e`` says the pipe's reader has left (``BrokenPipeError``, or an ``OSError``
    with ``EPIPE``)."""
    return isinstance(e, BrokenPipeError) or e.errno == errno.EPIPE


def _to_devnull(stream: Any) -> None:
    """Point ``stream``'s file descriptor at ``os.devnull``, so that every holder of it
    (the stream itself, Python's flush at shutdown, a library that kept a reference)
    writes there from now on without an error; nothing where it has no descriptor."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


class _Guarded:
    """A text stream whose ``write`` and ``flush`` survive a reader that has left:
    the first ``BrokenPipeError`` (or ``EPIPE``) points the stream's descriptor at
    ``os.devnull`` (:func:`_to_devnull`), and from then on every write is dropped.
    Everything else is the wrapped stream's."""

    def __init__(self, stream: TextIO):
        self._stream = stream
        self._gone = False

    def write(self, text: str) -> int:
        if self._gone:
            return len(text)
        try:
            return self._stream.write(text)
        except OSError as e:
            if not _reader_gone(e):
                raise
            self._leave()
            return len(text)

    def flush(self) -> None:
        if self._gone:
            return
        try:
            self._stream.flush()
        except OSError as e:
            if not _reader_gone(e):
                raise
            self._leave()

    def _leave(self) -> None:
        self._gone = True
        _to_devnull(self._stream)
        with contextlib.suppress(OSError):  # the text left in its buffer: to os.devnull
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def guarded_stdout() -> Iterator[None]:
    """``sys.stdout`` wrapped for the block (:class:`_Guarded`), restored on exit,
    flushed through the guard first: a reader that leaves (``| head -1``) stops no
    write to stdout inside, a library's included. mlx-lm's ``rprint`` is ``print`` and
    its rich ``Console`` reads ``sys.stdout`` at each write (``make_console`` passes no
    file), so both go through the guard; rich's own handling of a broken pipe is
    ``SystemExit(1)``, and ``print`` raised ``BrokenPipeError``: the run was lost
    (found by review, session 50). Once the reader has gone the descriptor points at
    ``os.devnull``, so Python's flush of stdout at shutdown raises nothing either (no
    "Exception ignored ... BrokenPipeError", no exit status 120)."""
    original = sys.stdout
    if original is None:  # (pythonw: no stdout to guard)
        yield
        return
    guarded = _Guarded(original)
    sys.stdout = guarded
    try:
        yield
    finally:
        try:
            guarded.flush()
        finally:
            if sys.stdout is guarded:  # (rebound inside: that binding is kept)
                sys.stdout = original
