"""The ``chatlane`` command's entry point (the script and ``python -m chatlane``), and how
a Ctrl-C or a SIGTERM that comes before ``chatlane serve`` is ready ends.

What stays true:

* A Ctrl-C before the gateway is ready — while Python still imports chatlane,
  while the configuration is read, the store opened or the adapters started —
  ends with the one line :data:`STOPPED_EARLY` and exit status
  :data:`INTERRUPTED`, never a traceback (:func:`stopped_early`).
* A SIGTERM then ends the same way, with exit status :data:`TERMINATED`:
  :data:`EARLY_SIGTERM` takes it while Python imports chatlane (:func:`main`) and
  while ``chatlane serve`` starts, until uvicorn handles the signals; once the
  gateway is ready, SIGTERM shuts it down gracefully, as ever.
* This module imports nothing, of chatlane's or anyone's, before it can catch
  that Ctrl-C (``signal``, for SIGTERM's handler, is imported under that watch
  too); the package's ``__init__`` imports nothing either, so the command line's
  imports all happen under :func:`main`'s watch.
"""

TYPE_CHECKING = False  # as typing's: type checkers read the block below, Python skips it
if TYPE_CHECKING:
    from asyncio import Task
    from types import FrameType, TracebackType

STOPPED_EARLY = "chatlane stopped before it started"
"""What a command stopped by Ctrl-C or SIGTERM before it was ready prints."""

INTERRUPTED = 130
"""The exit status then: 128 + SIGINT, as a shell reports a command Ctrl-C ended."""

TERMINATED = 143
"""The exit status when SIGTERM stopped it: 128 + SIGTERM, as a shell reports a command
``kill`` ended."""


class Terminated(KeyboardInterrupt):
    """SIGTERM came before the gateway was ready, outside the start's event loop: raised
    where the main thread is, as Python raises :class:`KeyboardInterrupt` for Ctrl-C, so
    that what ends an early Ctrl-C ends it too (:func:`exit_status` tells them apart)."""


def exit_status(stop: KeyboardInterrupt) -> int:
    """The exit status of a start ``stop`` ended: :data:`TERMINATED` for a
    :class:`Terminated`, else :data:`INTERRUPTED`."""
    return TERMINATED if isinstance(stop, Terminated) else INTERRUPTED


class EarlySigterm:
    """SIGTERM's handler from the process's first moments until the gateway is ready
    (:data:`EARLY_SIGTERM`, the only one).

    What stays true:

    * Entered (``with EARLY_SIGTERM:``), it handles SIGTERM, unless SIGTERM was
      ignored or had a handler (the parent's or the embedding program's choice
      then stands) or this is not the main thread; left, SIGTERM's default is
      back and its state is as new. It is not entered twice at once.
    * While no start's task is named (:attr:`start`), SIGTERM raises
      :class:`Terminated` in the main thread.
    * While one is, SIGTERM cancels that task and wakes its event loop, as
      :func:`asyncio.run` does for Ctrl-C, and :attr:`came` turns true: the
      start closes what it opened as it does for a Ctrl-C. (uvicorn handles
      SIGTERM itself while it runs, and gives it back here when it ends.)
    * Once the gateway was ready (:attr:`ready`), SIGTERM has its default
      action: by the time it comes here again, uvicorn has shut the gateway down.
    """

    def __init__(self) -> None:
        self.start: Task[object] | None = None
        """The start's task, cancelled by SIGTERM; ``None``: SIGTERM raises
        :class:`Terminated`."""
        self.came = False
        """Whether SIGTERM cancelled :attr:`start`."""
        self.ready = False
        """Whether the gateway was ready (SIGTERM then has its default action)."""
        self._taken = False
        """Whether SIGTERM's handler is this one's, to give back."""

    def _reset(self) -> None:
        """As new: no start, no SIGTERM came, not ready, SIGTERM not taken."""
        self.start, self.came, self.ready, self._taken = None, False, False, False

    def __enter__(self) -> None:
        import signal

        self._reset()
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return
        try:
            signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: its signals are not this thread's to take
            return
        self._taken = True

    def __exit__(
        self,
        kind: "type[BaseException] | None",
        error: "BaseException | None",
        traceback: "TracebackType | None",
    ) -> None:
        import signal

        if self._taken:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self._reset()

    def _handle(self, signum: int, frame: "FrameType | None") -> None:
        """What SIGTERM does now: see the class's docstring."""
        start = self.start
        if self.ready:
            import signal

            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
        elif start is not None and not start.done():
            self.came = True
            start.cancel()
            start.get_loop().call_soon_threadsafe(lambda: None)  # a loop in select() wakes
        else:
            raise Terminated


EARLY_SIGTERM = EarlySigterm()
"""SIGTERM's handler until the gateway is ready."""


def stopped_early(status: int = INTERRUPTED) -> int:
    """Say that chatlane stopped before it started; return the exit status to end with."""
    print(STOPPED_EARLY, flush=True)
    # A KeyboardInterrupt that passed through an exec() of a string (dataclasses makes its
    # methods so) leaves CPython set to end a `python -m` run by SIGINT, whatever status it
    # exits with; code run through exec() again clears that, so the status is this one.
    exec("")
    return status


def main() -> None:
    """Run the command line; a Ctrl-C or a SIGTERM while it is still being imported ends
    as :func:`stopped_early` says."""
    try:
        with EARLY_SIGTERM:
            from chatlane.cli import main as command_line
    except KeyboardInterrupt as stop:
        raise SystemExit(stopped_early(exit_status(stop))) from None
    command_line(prog_name="chatlane")
