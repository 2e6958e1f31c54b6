"""chatlane: the session-and-turn runtime for AI chat-agent gateways.

The names below are loaded when first used (:func:`__getattr__`): importing the
package itself imports nothing, so the ``chatlane`` command can catch a Ctrl-C
before any of its imports begin (:mod:`chatlane.console`).
"""

TYPE_CHECKING = False  # as typing's: type checkers read the block below, Python skips it
if TYPE_CHECKING:
    from chatlane.errors import (
        ChatlaneError,
        ConfigError,
        InvalidSessionKey,
        InvalidSource,
        LeaseError,
        LeaseLost,
        SessionBusy,
        StaleGeneration,
    )
    from chatlane.identity import (
        ChatType,
        KeyPolicy,
        SessionKey,
        SessionSource,
        build_session_key,
        check_session_key,
        parse_session_key,
    )

    __version__: str

_HOMES = {
    **dict.fromkeys(
        (
            "ChatlaneError",
            "ConfigError",
            "InvalidSessionKey",
            "InvalidSource",
            "LeaseError",
            "LeaseLost",
            "SessionBusy",
            "StaleGeneration",
        ),
        "chatlane.errors",
    ),
    **dict.fromkeys(
        (
            "ChatType",
            "KeyPolicy",
            "SessionKey",
            "SessionSource",
            "build_session_key",
            "check_session_key",
            "parse_session_key",
        ),
        "chatlane.identity",
    ),
}
"""Where each name the package offers is defined."""


def __getattr__(name: str) -> object:
    """The package's names, each imported from its module the first time it is asked for."""
    if name == "__version__":
        value: object = _version()
    elif name in _HOMES:
        import importlib

        value = getattr(importlib.import_module(_HOMES[name]), name)
    else:
        raise AttributeError(f"module 'chatlane' has no attribute {name!r}")
    globals()[name] = value
    return value


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("chatlane")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree without install
        return "0.0.0+unknown"


__all__ = [
    "ChatType",
    "ChatlaneError",
    "ConfigError",
    "InvalidSessionKey",
    "InvalidSource",
    "KeyPolicy",
    "LeaseError",
    "LeaseLost",
    "SessionBusy",
    "SessionKey",
    "SessionSource",
    "StaleGeneration",
    "__version__",
    "build_session_key",
    "check_session_key",
    "parse_session_key",
]
