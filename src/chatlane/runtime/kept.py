"""Messages whose drop from the store failed: they were told they still wait.

``/stop``, ``/unqueue``, a cancelled API request and a busy policy's refusal
take a waiting message out of this process's queue, then drop its record from
the store. When the drop fails, the message waits here again, in its place,
and runs. What stays true:

* A drop that surely did not apply (an error saying so, or a store whose
  answers are never lost) left the record as it was: nothing more is asked.
* A drop that may have applied all the same — a Redis or PostgreSQL call
  whose answer was lost — is undone first: each message is queued in the
  store again under its own ``seq`` (:meth:`~chatlane.stores.base.Store.enqueue`
  with ``seq``), in its place among the others, so it survives this process
  as any queued message does. A record the drop had left stays as it was.
* Only while that fails too does a message wait from this process's memory
  alone, counted as stored (:func:`~chatlane.runtime.pending.kept_after_drop`):
  should the process end before it runs, it is lost.
* While its record is queued again, the message waits nowhere here, as while
  its drop was asked: no turn can answer it before its record is back, which
  would leave a record no commit removes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from chatlane.errors import ChatlaneError, StoreError
from chatlane.logs import turn_fields
from chatlane.runtime import pending
from chatlane.state import SessionState
from chatlane.stores.base import Store
from chatlane.stores.codec import encode_message
from chatlane.types import InboundMessage

log = logging.getLogger("chatlane.runtime")


class KeptMessages:
    """Puts back into the store what a failed drop may have taken (see the module docstring)."""

    def __init__(self, store: Store, holder: str) -> None:
        self._store = store
        self._holder = holder

    async def keep(
        self,
        state: SessionState,
        kept: Sequence[tuple[InboundMessage, int]],
        error: ChatlaneError,
    ) -> None:
        """Make sure the store holds ``kept`` (the session's messages and their seqs), whose
        drop failed with ``error``; those it may not hold count as stored here
        (:func:`~chatlane.runtime.pending.kept_after_drop`). Called before they wait again."""
        if not self._store.may_have_applied(error):
            return
        store, holder, key = self._store, self._holder, state.key
        try:
            for message, seq in kept:
                await store.enqueue(key, message.id, holder, encode_message(message), seq=seq)
        except StoreError as again:
            log.warning(
                "could not queue again %d message(s) whose drop may have applied; they wait "
                "in this process alone: %s",
                len(kept),
                again,
                extra=turn_fields(key),
            )
            pending.kept_after_drop(state, [seq for _, seq in kept], unsure=True)
