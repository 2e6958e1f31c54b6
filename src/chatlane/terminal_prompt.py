"""The interactive prompt of ``chatlane chat``: line editing, history, completion, Ctrl-C.

What stays true:

* The prompt stays live while replies stream: their text is printed above it
  and it is drawn again below (prompt_toolkit's ``patch_stdout``), so an
  approval request is answered by typing ``/approve`` at once, and the prompt
  is never lost under a status line.
* Lines are edited in place (arrow keys, Emacs keys), recalled with the arrow
  keys and searched with Ctrl-R, from a history file kept between runs (mode
  0600, in a folder of mode 0700). A history file that cannot be kept is held
  in memory for this run, and the client says so once.
* Tab completes the slash commands the gateway knows (``GET /admin/commands``),
  and ``/quit``.
* Ctrl-C while a reply is awaited stops the turn (the conversation sends
  ``/stop``); on a line being typed it clears the line; at an empty prompt it
  leaves. Ctrl-D at an empty prompt leaves.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import CompleteEvent, Completer, Completion
from prompt_toolkit.document import Document
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.key_binding import KeyBindings, KeyPressEvent

PROMPT = "> "


@dataclass(frozen=True)
class Command:
    """A slash command the prompt completes: its name and one-line summary."""

    name: str
    summary: str = ""


QUIT = Command("quit", "leave the conversation (the client's own command)")


class CommandCompleter(Completer):
    """Completes ``/name`` at the start of a line from the gateway's commands."""

    def __init__(self, commands: Iterable[Command]) -> None:
        self.commands = sorted({*commands, QUIT}, key=lambda command: command.name)

    def get_completions(
        self, document: Document, complete_event: CompleteEvent
    ) -> Iterator[Completion]:
        typed = document.text_before_cursor
        if not typed.startswith("/") or any(c.isspace() for c in typed):
            return
        for command in self.commands:
            if command.name.startswith(typed[1:].lower()):
                yield Completion(
                    "/" + command.name, start_position=-len(typed), display_meta=command.summary
                )


def open_history(path: Path) -> tuple[History, str]:
    """A history kept in ``path``; or, if that cannot be, one in memory and the reason."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.close(os.open(path, os.O_CREAT | os.O_APPEND | os.O_WRONLY, 0o600))
        return FileHistory(path), ""
    except (OSError, RuntimeError) as error:  # RuntimeError: no home folder to be found
        return InMemoryHistory(), f"the line history is not kept ({path}: {error})"


class Prompt:
    """Reads lines with an editor until Ctrl-D or Ctrl-C at an empty prompt.

    :param busy: whether replies are awaited (Ctrl-C then stops the turn).
    :param stop: what Ctrl-C does while ``busy()``.
    :param above: the text shown on the line above the prompt (a reply's
        unfinished line, as it streams), asked at every redraw.
    """

    def __init__(
        self,
        history: History,
        commands: Sequence[Command],
        busy: Callable[[], bool],
        stop: Callable[[], None],
        above: Callable[[], str] = str,
    ) -> None:
        self._busy = busy
        self._stop = stop
        self._above = above
        self.session: PromptSession[str] = PromptSession(
            history=history,
            completer=CommandCompleter(commands),
            complete_while_typing=False,
            key_bindings=self._keys(),
        )

    def _keys(self) -> KeyBindings:
        keys = KeyBindings()

        @keys.add("c-c")
        def _ctrl_c(event: KeyPressEvent) -> None:
            buffer = event.app.current_buffer
            if self._busy():
                buffer.reset()
                self._stop()
            elif buffer.text:
                buffer.reset()
            else:
                event.app.exit(exception=KeyboardInterrupt())

        return keys

    def _message(self) -> str:
        above = self._above()
        return f"{above}\n{PROMPT}" if above else PROMPT

    async def read(self) -> str | None:
        """One line; ``None`` for Ctrl-D at an empty prompt.

        :raises KeyboardInterrupt: for Ctrl-C at an empty prompt with no reply awaited.
        """
        try:
            return await self.session.prompt_async(self._message, handle_sigint=False)
        except EOFError:
            return None

    async def until_closed(self, put: Callable[[str | None], None]) -> None:
        """Hand each line to ``put``, then ``None`` at Ctrl-D; Ctrl-C at an empty prompt
        raises :class:`KeyboardInterrupt`."""
        while True:
            line = await self.read()
            put(line)
            if line is None:
                return


__all__ = ["PROMPT", "Command", "CommandCompleter", "Prompt", "open_history"]
