"""What the store URLs that carry credentials share: masking them, and refusing a URL
whose password cannot be told apart from the rest.

What stays true:

* :func:`mask_userinfo` hides everything between ``://`` and the last ``@`` before the
  first ``/``: a password holding ``@`` (the address still reads as intended, since the
  host follows the last ``@``) is hidden whole, not only up to its first ``@``.
* A password holding an unencoded ``/``, ``?`` or ``#`` ends the address early: what
  follows it would be read as the path, query or fragment, and what precedes it as the
  host and port. :func:`split` refuses such a URL (an ``@`` left in the path, the
  fragment or an option's name gives it away), and :func:`port` a port that is not a
  number, with :data:`MALFORMED`: neither the URL nor the parser's own words, which quote
  what it took for a port or a field, appear in the message.
"""

from __future__ import annotations

from urllib.parse import SplitResult, urlsplit

from chatlane.errors import StoreError

__all__ = ["MALFORMED", "mask_userinfo", "port", "split"]

MALFORMED = (
    "malformed (a port that is not a number, or a password with reserved characters: "
    "percent-encode them, e.g. @ as %40, / as %2F, ? as %3F, # as %23)"
)


def mask_userinfo(url: str) -> str:
    """``url`` with the password of its ``user:password@`` (if any) replaced by ``***``.

    When an ``@`` follows the first ``/`` in the path, where the password ends cannot be
    told (an unencoded ``/`` in it): everything after ``://`` is hidden (and the whole of a
    URL with an ``@`` but no ``://``).
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return "…" if "@" in url else url
    authority, slash, after = rest.partition("/")
    if "@" in after.partition("?")[0].partition("#")[0]:
        return f"{scheme}://…"
    userinfo, at, host = authority.rpartition("@")
    if not at:
        return url
    user, colon, _ = userinfo.partition(":")
    shown = f"{user}:***" if colon else userinfo
    return f"{scheme}://{shown}@{host}{slash}{after}"


def split(url: str, what: str) -> SplitResult:
    """``url``'s parts, once no ``@`` is left where a password's tail would land.

    :raises StoreError: ``{what}: malformed (…)``, without the URL.
    """
    try:
        parts = urlsplit(url)
    except ValueError:  # an unbalanced [ or ] in the address
        raise StoreError(f"{what}: {MALFORMED}") from None
    names = (field.partition("=")[0] for field in parts.query.split("&"))
    if "@" in parts.path or "@" in parts.fragment or any("@" in name for name in names):
        raise StoreError(f"{what}: {MALFORMED}")
    return parts


def port(parts: SplitResult, what: str) -> int | None:
    """The port ``parts`` name, if any.

    :raises StoreError: it is not a number from 0 to 65535 (:data:`MALFORMED`).
    """
    try:
        return parts.port
    except ValueError:
        raise StoreError(f"{what}: {MALFORMED}") from None
