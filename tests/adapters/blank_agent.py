"""An agent whose replies show nothing, for the chat adapters' tests of blank replies."""

from __future__ import annotations

from chatlane.runtime.turn import Turn

AGENT = "python:tests.adapters.blank_agent:reply"
"""The ``agent.name`` that names :func:`reply`."""
SPACES = "   \n "
INVISIBLE = " \n\u200b\t"
"""Whitespace and a zero-width space: not empty to ``str.strip``, yet nothing to see."""


async def reply(turn: Turn) -> str:
    """:data:`INVISIBLE` for ``zero-width``, else :data:`SPACES`."""
    return INVISIBLE if turn.text == "zero-width" else SPACES
