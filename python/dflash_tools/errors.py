"""Exit codes and the top-level guard of the Python tools (`dflash data ...`, `dflash report`).

No tool ends in a raw traceback: a known failure raises Fatal(code, message) and prints
"error: MESSAGE" with its code; anything else becomes one line "error: PROG: internal error:
TYPE: MESSAGE" with exit 1 (DFLASH_TRACEBACK=1 prints the traceback too). The codes are the
CLI's (docs/data.md#exit-codes): 0 ok, 1 other failure, 2 usage / config, 4 bad data.
"""

import errno
import os
import signal
import sys
import traceback

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2
EXIT_DATA = 4
# The longest message printed for an unexpected error (an exception can carry a whole record).
MAX_MESSAGE_CHARS = 400


class Fatal(Exception):
    """A failure with a documented exit code; the message names the file (and line) it is about."""

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code

    def __reduce__(self):  # rebuilt with both arguments when it crosses a process boundary
        return (Fatal, (self.code, str(self)))


def short(text, limit=MAX_MESSAGE_CHARS):
    text = str(text)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def os_error_text(e):
    """'strerror' of an OSError (with its errno name), without Python's '[Errno N]' prefix."""
    name = errno.errorcode.get(e.errno, "") if e.errno else ""
    return f"{e.strerror or e} ({name})" if name else str(e.strerror or e)


def _terminate(signum, frame):
    raise SystemExit(128 + signum)


def guard(prog, fn, *args):
    """fn(*args) -> its exit code; no exception escapes. SIGTERM unwinds like an exception, so that
    temporary files are removed by the `finally` blocks that own them."""
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        try:
            signal.signal(signal.SIGTERM, _terminate)
        except ValueError:  # not the main thread
            pass
    try:
        return fn(*args)
    except Fatal as e:
        _print(f"error: {e}")
        return e.code
    except SystemExit:
        raise
    except KeyboardInterrupt:
        _print(f"error: {prog}: interrupted")
        return 130
    except BrokenPipeError:  # stdout closed by a reader that went away (`| head`)
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return EXIT_FAILURE
    except MemoryError:
        _print(f"error: {prog}: out of memory")
        return EXIT_FAILURE
    except RecursionError:
        _print(f"error: {prog}: input nested too deeply (recursion limit)")
        return EXIT_FAILURE
    except OSError as e:
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        _print(f"error: {prog}: {where}{os_error_text(e)}")
        _traceback()
        return EXIT_FAILURE
    except Exception as e:  # noqa: BLE001 - the point of the guard
        _print(f"error: {prog}: internal error: {type(e).__name__}: {short(e)}"
               + ("" if os.environ.get("DFLASH_TRACEBACK") else " (DFLASH_TRACEBACK=1 prints the traceback)"))
        _traceback()
        return EXIT_FAILURE


def _print(msg):
    try:
        print(short(msg, 4000), file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _traceback():
    if os.environ.get("DFLASH_TRACEBACK"):
        traceback.print_exc()
