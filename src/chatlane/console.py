"""The ``chatlane`` command's entry point (the script and ``python -m chatlane``), and how
a Ctrl-C that comes before ``chatlane serve`` is ready ends.

What stays true:

* A Ctrl-C before the gateway is ready — while Python still imports chatlane,
  while the configuration is read, the store opened or the adapters started —
  ends with the one line :data:`STOPPED_EARLY` and exit status
  :data:`INTERRUPTED`, never a traceback (:func:`stopped_early`).
* This module imports nothing, of chatlane's or anyone's, before it can catch
  that Ctrl-C; the package's ``__init__`` imports nothing either, so the
  command line's imports all happen under :func:`main`'s watch.
"""

STOPPED_EARLY = "chatlane stopped before it started"
"""What a command stopped by Ctrl-C before it was ready prints."""

INTERRUPTED = 130
"""The exit status then: 128 + SIGINT, as a shell reports a command Ctrl-C ended."""


def stopped_early(status: int = INTERRUPTED) -> int:
    """Say that chatlane stopped before it started; return the exit status to end with."""
    print(STOPPED_EARLY, flush=True)
    # A KeyboardInterrupt that passed through an exec() of a string (dataclasses makes its
    # methods so) leaves CPython set to end a `python -m` run by SIGINT, whatever status it
    # exits with; code run through exec() again clears that, so the status is this one.
    exec("")
    return status


def main() -> None:
    """Run the command line; a Ctrl-C while it is still being imported ends as
    :func:`stopped_early` says."""
    try:
        from chatlane.cli import main as command_line
    except KeyboardInterrupt:
        raise SystemExit(stopped_early()) from None
    command_line(prog_name="chatlane")
