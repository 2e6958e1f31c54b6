"""What one socket's page shows, so that each message shows there once.

The page (``static/app.js``) draws the events it is sent in order, and a
``history`` event replaces everything it showed. A :class:`View` follows the
events of one socket and lets through only those that add to its page. What
stays true:

* Nothing is sent about a message the last ``history`` shows: its turn
  committed before that transcript was read, so the history shows its answer
  too. A reply, chunk, approval, state or outcome of that turn that comes
  later (delivered after the history was read) is left out.
* Between two histories, a message's ``user`` event and an approval request's
  prompt are sent once while the message is open. Its ``outcome``, or a
  ``state`` of ``command`` or ``refused``, ends it, and the view forgets it:
  what it keeps is bounded by the messages open in its chat.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from chatlane.adapters.web_wire import Event, MessageState

ENDING_STATES = frozenset({MessageState.COMMAND.value, MessageState.REFUSED.value})
"""The ``state`` values after which a message has no outcome to come."""


@dataclass(eq=False, slots=True)
class View:
    """The messages one socket's page shows (see the module docstring)."""

    committed: frozenset[str] = frozenset()
    """Ids of the user messages the last history showed: their turns committed."""
    users: set[str] = field(default_factory=set)
    """Ids of the open messages a ``user`` event showed since that history."""
    approvals: dict[str, str] = field(default_factory=dict)
    """The approval prompts shown since that history: request id -> its turn's message id."""

    def admits(self, event: Event) -> bool:
        """Whether ``event`` adds to the page; if it does, the view notes what it shows."""
        kind, about = event["type"], event.get("id", "")
        if kind == "history":
            self._replaced(event)
            return True
        if about in self.committed:
            return False
        if kind == "user":
            return _first(self.users, about)
        if kind == "approval" and (request := event.get("approval_id")):
            if request in self.approvals:
                return False
            self.approvals[request] = about
        elif kind == "outcome" or (kind == "state" and event["state"] in ENDING_STATES):
            self._ended(about)
        return True

    def _replaced(self, history: Event) -> None:
        """The page now shows ``history`` alone."""
        self.committed = frozenset(m["id"] for m in history["messages"] if m["id"])
        self.users.clear()
        self.approvals.clear()

    def _ended(self, message_id: str) -> None:
        """``message_id`` ended: no ``user`` event nor prompt of it comes any more."""
        self.users.discard(message_id)
        if self.approvals:
            self.approvals = {r: m for r, m in self.approvals.items() if m != message_id}


def _first(seen: set[str], message_id: str) -> bool:
    """Whether ``message_id`` is not in ``seen`` yet; it is from now on."""
    if message_id in seen:
        return False
    seen.add(message_id)
    return True
