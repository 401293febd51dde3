"""The errors of the command-line tools, and the one way they end a run.

Every message names the offending value, what was expected and how to fix it, because the user sees
it as the final line of a failed run. All four commands (`attnres-convert`, `attnres-quantize`,
`attnres-retrofit`, `attnres-serve`) print it as `PROG: error: MESSAGE` on stderr and exit with

- 0: done;
- 1: the work failed: an input that cannot be used (missing, corrupt, the wrong kind of model), a
  failed verification, an unreachable registry or Hub;
- 2: bad usage: the command line itself is wrong (argparse's own errors, an option value out of range,
  options that do not go together), found before any input is read;
- 130: interrupted (Ctrl-C) in the checkpoint tools, with nothing half-written left behind.
"""

import sys

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


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


def hub_reason(err: BaseException, revision: str | None = None, writing: bool = False) -> str:
    """Why a Hub call failed, in one line: `huggingface_hub`'s messages span several lines (a URL, a request
    id, advice), and the command's message must stay the last line of the run. Known causes are named
    with their fix (`writing`: the call was a push); anything else is its type and first line."""
    from huggingface_hub import constants, errors

    cause = err.__cause__
    if isinstance(err, errors.IncompleteSnapshotError):
        return "the local Hub cache holds only part of it (download it again while online)"
    if isinstance(err, errors.OfflineModeIsEnabled) or isinstance(cause, errors.OfflineModeIsEnabled) or (
            isinstance(err, errors.LocalEntryNotFoundError) and cause is None and constants.is_offline_mode()):
        if writing:
            return "offline mode (HF_HUB_OFFLINE=1 or TRANSFORMERS_OFFLINE=1) forbids uploading; unset it to push"
        at = f" at revision {revision!r}" if revision is not None else ""
        return (f"it is not in the local Hub cache{at}, and offline mode (HF_HUB_OFFLINE=1 or TRANSFORMERS_OFFLINE=1) "
                "forbids downloading it")
    if isinstance(err, errors.LocalEntryNotFoundError) and cause is not None:   # the Hub failed, no cached copy
        return f"{hub_reason(cause, revision, writing)}; it is not in the local Hub cache either"
    if isinstance(err, errors.LocalTokenNotFoundError):
        return "no Hub token was found (log in with `hf auth login` or set HF_TOKEN)"
    if isinstance(err, errors.RevisionNotFoundError):
        return f"the repo has no revision {revision!r}"
    if isinstance(err, errors.GatedRepoError):
        return "the repo is gated (accept its terms on the Hub, then set HF_TOKEN to a token of that account)"
    if isinstance(err, errors.RepositoryNotFoundError):
        return "the Hub has no such repo, or it is private and your token (HF_TOKEN) has no access to it"
    status = getattr(getattr(err, "response", None), "status_code", None)
    if status == 401:
        return "the Hub refused the token (HTTP 401: set HF_TOKEN to a valid token)"
    if status == 403:
        return (f"the token has no {'write ' if writing else ''}access to that repo (HTTP 403: use a token of an "
                f"account that may {'write to' if writing else 'read'} it)")
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    first = lines[0] if lines else "no message"
    if status is not None:
        return f"the Hub answered HTTP {status} ({first})"
    if isinstance(err, (ConnectionError, TimeoutError)) or type(err).__module__.startswith(("httpx", "httpcore")):
        return f"the Hub could not be reached ({type(err).__name__}: {first}; check the network or HF_ENDPOINT)"
    return f"{type(err).__name__}: {first}"


def listing(items, limit: int = 20) -> str:
    """Sorted, comma-separated names; long lists are cut with a count so the error stays readable."""
    items = sorted(items)
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown}, ... ({len(items) - limit} more)"
