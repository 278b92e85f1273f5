"""``chunkscan <command>``: dispatch to the sub-commands.

- ``chunkscan repro``: reproduce the memory growth and show the fix
  (:mod:`chunkscan.commands.repro`).
- ``chunkscan lora``: ``mlx_lm.lora`` with the Gated DeltaNet patch
  (:mod:`chunkscan.commands.lora`).

``chunkscan --version`` (``-V``) prints the package's version.
"""

from __future__ import annotations

import importlib
import signal
import sys
import threading

COMMANDS = {
    "repro": ("chunkscan.commands.repro", "reproduce MLX issue #4837 and show the fix"),
    "lora": ("chunkscan.commands.lora", "mlx_lm.lora, recurrences and attention chunked"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        lines = [f"  {name:<8}{help_}" for name, (_, help_) in COMMANDS.items()]
        # usage asked for: stdout, status 0; no command: stderr, status 2 (as argparse)
        out = sys.stdout if argv else sys.stderr
        print("usage: chunkscan <command> [options]  (or --version)\n\ncommands:\n"
              + "\n".join(lines), file=out)  # fmt: skip
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):  # "unknown command" before (found by probing)
        from .. import __version__

        if argv[1:]:  # ignored before, exit 0 (found by probing)
            print(f"chunkscan: {argv[0]} takes no arguments, got {argv[1:]}.", file=sys.stderr)
            return 2
        print(f"chunkscan {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(
            f"chunkscan: unknown command {name!r}; choose one of {', '.join(COMMANDS)}.",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    handled = _exit_on_sigterm()
    try:
        return int(module.main(rest) or 0)
    except KeyboardInterrupt:  # after the command's cleanup: a line, not a traceback
        print(f"chunkscan {name}: interrupted", file=sys.stderr)
        return 130
    finally:
        if handled:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _exit_on_sigterm() -> bool:
    """SIGTERM (``timeout``'s signal, a scheduler's) raises ``SystemExit(143)`` in the
    main thread while a command runs, so that its cleanup runs as it does for Ctrl-C:
    it ended the process at once, leaving the demo's temporary model and repro's
    reference gradients in the temporary folder (found by probing). A handler of the
    caller's own is kept. Whether the handler was set."""
    if threading.current_thread() is not threading.main_thread():
        return False
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return False
    signal.signal(signal.SIGTERM, _terminated)
    return True


def _terminated(signum: int, frame: object) -> None:
    sys.exit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
