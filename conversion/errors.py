"""The errors of the command-line tools, and the one way they end a run.

Every message names the offending value, what was expected and how to fix it, because the user sees
it as the final line of a failed run. All four commands (`attnres-convert`, `attnres-quantize`,
`attnres-retrofit`, `attnres-serve`) print it as `PROG: error: MESSAGE` on stderr and exit with

- 0: done;
- 1: the work failed: an input that cannot be used (missing, corrupt, the wrong kind of model), a
  failed verification, an unreachable registry or Hub;
- 2: bad usage: the command line itself is wrong (argparse's own errors, an option value out of range,
  options that do not go together), found before any input is read.
"""

import sys

EXIT_FAILED = 1
EXIT_USAGE = 2


class ConversionError(ValueError):
    """A checkpoint or option the converter cannot turn into a faithful AttnRes checkpoint (exit 1)."""

    exit_status = EXIT_FAILED


class UsageError(ConversionError):
    """The command line itself is wrong: an option value or a combination of options (exit 2)."""

    exit_status = EXIT_USAGE


def fail(prog: str, err: BaseException | str, status: int | None = None) -> int:
    """End a command on `err`: print `PROG: error: MESSAGE` on stderr and return the exit status
    (`status`, else the error's own `exit_status`, else `EXIT_FAILED`)."""
    print(f"{prog}: error: {err}", file=sys.stderr, flush=True)
    return status if status is not None else getattr(err, "exit_status", EXIT_FAILED)


def listing(items, limit: int = 20) -> str:
    """Sorted, comma-separated names; long lists are cut with a count so the error stays readable."""
    items = sorted(items)
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown}, ... ({len(items) - limit} more)"
