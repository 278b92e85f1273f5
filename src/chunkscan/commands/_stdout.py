"""Printing progress to a stdout its reader may close (``chunkscan repro | head -1``)."""

from __future__ import annotations

import os
import sys


def say(text: str) -> None:
    """Print ``text`` to stdout, flushed; once the reader has closed it (``| head``),
    stdout goes to ``os.devnull`` and the run goes on: the next line raised
    ``BrokenPipeError`` and the run was lost (``chunkscan repro``: every configuration
    measured, ``repro.json`` unwritten; ``chunkscan lora``: the training, at its banner;
    found by probing, sessions 49 and 50). Later writes to stdout, a library's too, go
    to ``os.devnull``."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
