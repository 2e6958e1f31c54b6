"""Session identity: the key rules, escaping, parsing and clear errors."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chatlane.errors import InvalidSessionKey, InvalidSessionName, InvalidSource
from chatlane.identity import (
    ChatType,
    KeyPolicy,
    SessionKeyParts,
    SessionSource,
    build_session_key,
    check_session_key,
    check_session_name,
    parse_session_key,
)

DEFAULT_POLICY = KeyPolicy()


def key(policy: KeyPolicy = DEFAULT_POLICY, **fields: object) -> str:
    return build_session_key(SessionSource(**fields), policy)  # type: ignore[arg-type]


class TestDirectMessages:
    def test_one_session_per_dm_chat(self) -> None:
        assert key(platform="tg", chat_id="42", user_id="7") == "main:tg:dm:42"
        assert key(platform="tg", chat_id="42", user_id="8") == "main:tg:dm:42"

    def test_user_appended_only_without_chat_id(self) -> None:
        assert key(platform="tg", user_id="7") == "main:tg:dm:::7"

    def test_thread_appended_when_present(self) -> None:
        assert key(platform="tg", chat_id="42", thread_id="9") == "main:tg:dm:42:9"

    def test_thread_and_user_without_chat(self) -> None:
        assert key(platform="tg", thread_id="9", user_id="7") == "main:tg:dm::9:7"


class TestGroups:
    @pytest.mark.parametrize("chat_type", ["group", "channel", "thread"])
    def test_per_user_outside_threads_by_default(self, chat_type: str) -> None:
        got = key(platform="tg", chat_type=chat_type, chat_id="-1", user_id="7")
        assert got == f"main:tg:{chat_type}:-1::7"

    def test_shared_when_not_per_user(self) -> None:
        policy = KeyPolicy(group_sessions_per_user=False)
        a = key(policy, platform="tg", chat_type="group", chat_id="-1", user_id="7")
        b = key(policy, platform="tg", chat_type="group", chat_id="-1", user_id="8")
        assert a == b == "main:tg:group:-1"

    def test_thread_is_shared_by_default(self) -> None:
        a = key(platform="tg", chat_type="group", chat_id="-1", thread_id="5", user_id="7")
        b = key(platform="tg", chat_type="group", chat_id="-1", thread_id="5", user_id="8")
        assert a == b == "main:tg:group:-1:5"

    def test_thread_before_user_when_per_user_threads(self) -> None:
        policy = KeyPolicy(thread_sessions_per_user=True)
        got = key(
            policy, platform="tg", chat_type="group", chat_id="-1", thread_id="5", user_id="7"
        )
        assert got == "main:tg:group:-1:5:7"

    def test_thread_never_mistaken_for_user(self) -> None:
        in_thread = key(
            KeyPolicy(group_sessions_per_user=False),
            platform="tg",
            chat_type="group",
            chat_id="-1",
            thread_id="7",
        )
        per_user = key(platform="tg", chat_type="group", chat_id="-1", user_id="7")
        assert in_thread != per_user

    def test_group_without_user_is_shared(self) -> None:
        assert key(platform="tg", chat_type="group", chat_id="-1") == "main:tg:group:-1"


class TestNormalisation:
    def test_namespace_is_first_segment(self) -> None:
        assert key(KeyPolicy(namespace="work"), platform="tg", chat_id="1").startswith("work:")

    def test_int_ids_equal_string_ids(self) -> None:
        assert SessionSource("tg", chat_id=42) == SessionSource("tg", chat_id="42")  # type: ignore[arg-type]

    def test_empty_ids_are_missing(self) -> None:
        assert SessionSource("tg", chat_id="1", thread_id="") == SessionSource("tg", chat_id="1")

    def test_chat_type_accepts_strings(self) -> None:
        source = SessionSource("tg", chat_id="1", chat_type="group")  # type: ignore[arg-type]
        assert source.chat_type is ChatType.GROUP

    def test_source_is_frozen(self) -> None:
        source = SessionSource("tg", chat_id="1")
        with pytest.raises(AttributeError):
            source.chat_id = "2"  # type: ignore[misc]


class TestErrors:
    def test_missing_platform(self) -> None:
        with pytest.raises(InvalidSource, match="platform"):
            key(platform="", chat_id="1")

    def test_missing_chat_and_user(self) -> None:
        with pytest.raises(InvalidSource, match="chat id or a user id"):
            key(platform="tg", thread_id="1")

    def test_unknown_chat_type(self) -> None:
        with pytest.raises(InvalidSource, match="chat_type"):
            SessionSource("tg", chat_id="1", chat_type="supergroup")  # type: ignore[arg-type]

    def test_invalid_source_is_a_value_error(self) -> None:
        with pytest.raises(ValueError, match="platform"):
            key(platform="", chat_id="1")

    def test_empty_namespace(self) -> None:
        with pytest.raises(InvalidSource, match="namespace"):
            KeyPolicy(namespace="")

    @pytest.mark.parametrize(
        "bad",
        [
            "",
            "a",
            "a:b:dm",
            "a:b:dm:1:2:3:4",
            "a:b:room:1",
            ":b:dm:1",
            "a::dm:1",
            "a:b:dm:1:",
            "a:b:dm:1:2:",
            "a:b:dm:",
        ],
    )
    def test_parse_and_check_reject_malformed(self, bad: str) -> None:
        with pytest.raises(InvalidSessionKey):
            parse_session_key(bad)
        with pytest.raises(InvalidSessionKey):
            check_session_key(bad)


class TestEscaping:
    def test_separator_in_id_is_escaped(self) -> None:
        assert key(platform="tg", chat_id="a:b") == "main:tg:dm:a%3Ab"

    def test_escape_char_in_id_is_escaped(self) -> None:
        assert key(platform="tg", chat_id="a%3Ab") == "main:tg:dm:a%253Ab"

    def test_separator_cannot_forge_a_thread(self) -> None:
        forged = key(platform="tg", chat_id="1:2")
        real = key(platform="tg", chat_id="1", thread_id="2")
        assert forged != real

    def test_odd_unicode_round_trips(self) -> None:
        weird = "çhät 🙂\u200b\n\x00:%"
        got = parse_session_key(key(platform="tg", chat_id=weird, thread_id=weird))
        assert (got.chat_id, got.thread_id) == (weird, weird)


ids = st.one_of(st.none(), st.text(alphabet=st.sampled_from(":%3Aa2b5"), max_size=6))
sources = st.builds(
    SessionSource,
    platform=st.text(alphabet=st.sampled_from(":%a3A"), min_size=1, max_size=4),
    chat_id=ids,
    chat_type=st.sampled_from(list(ChatType)),
    thread_id=ids,
    user_id=ids,
)
policies = st.builds(
    KeyPolicy,
    namespace=st.text(alphabet=st.sampled_from(":%mA3"), min_size=1, max_size=4),
    group_sessions_per_user=st.booleans(),
    thread_sessions_per_user=st.booleans(),
)


def identity_of(source: SessionSource, policy: KeyPolicy) -> tuple[object, ...]:
    """The components the key rules say a key depends on, computed independently."""
    if source.chat_id is None:
        with_user = True
    elif source.chat_type is ChatType.DM:
        with_user = False
    elif source.thread_id is not None:
        with_user = policy.thread_sessions_per_user
    else:
        with_user = policy.group_sessions_per_user
    user = source.user_id if with_user else None
    return (
        policy.namespace,
        source.platform,
        source.chat_type,
        source.chat_id,
        source.thread_id,
        user,
    )


def is_keyable(source: SessionSource) -> bool:
    return source.chat_id is not None or source.user_id is not None


@given(sources, policies, sources, policies)
def test_keys_collide_exactly_when_identities_do(
    a: SessionSource, pa: KeyPolicy, b: SessionSource, pb: KeyPolicy
) -> None:
    if not (is_keyable(a) and is_keyable(b)):
        return
    same_key = build_session_key(a, pa) == build_session_key(b, pb)
    assert same_key == (identity_of(a, pa) == identity_of(b, pb))


@given(sources, policies)
def test_parse_inverts_build(source: SessionSource, policy: KeyPolicy) -> None:
    if not is_keyable(source):
        return
    parts = parse_session_key(build_session_key(source, policy))
    namespace, platform, chat_type, chat_id, thread_id, user_id = identity_of(source, policy)
    assert parts == SessionKeyParts(namespace, platform, chat_type, chat_id, thread_id, user_id)  # type: ignore[arg-type]


@given(sources, policies)
def test_check_takes_every_built_key_as_it_is(source: SessionSource, policy: KeyPolicy) -> None:
    if not is_keyable(source):
        return
    built = build_session_key(source, policy)
    checked = check_session_key(str(built))
    assert checked == built
    assert type(checked) is str  # a SessionKey is a plain str at run time


@given(sources, policies)
def test_build_is_deterministic(source: SessionSource, policy: KeyPolicy) -> None:
    if is_keyable(source):
        assert build_session_key(source, policy) == build_session_key(source, policy)


# -- session names a client chooses -----------------------------------------------------

STRIP_ALIKE = ["x:y", " x:y", "x:y\x1c", "x:y\u0085"]
"""``str.strip`` turns every one of these into ``"x:y"``."""


def test_of_names_that_strip_alike_only_the_plain_one_is_accepted() -> None:
    assert check_session_name("x:y") == "x:y"
    for name, problem in [
        (" x:y", "U+0020 (SPACE), whitespace at the start, at position 0"),
        ("x:y\x1c", "U+001C, a control character, at position 3"),
        ("x:y\u0085", "U+0085, a control character, at position 3"),
        ("x:y\u2028", "U+2028 (LINE SEPARATOR), a line separator, at position 3"),
        ("x\u2029y", "U+2029 (PARAGRAPH SEPARATOR), a paragraph separator, at position 1"),
        ("x:y\u00a0", "U+00A0 (NO-BREAK SPACE), whitespace at the end, at position 3"),
        ("x\ud800", "U+D800, a lone surrogate, at position 1"),
        ("a\tb", "U+0009, a control character, at position 1"),
    ]:
        with pytest.raises(InvalidSessionName, match=re.escape(problem)):
            check_session_name(name)


def test_names_are_kept_exactly_however_unusual() -> None:
    for name in ["two words", "caf\u00e9", "cafe\u0301", "\U0001f468\u200d\U0001f469", "x\u3000y"]:
        assert check_session_name(name) is name
    with pytest.raises(InvalidSessionName, match="the 'user' field is empty"):
        check_session_name("", "the 'user' field")
    with pytest.raises(InvalidSessionName, match="longer than 256"):
        check_session_name("x" * 257)
    assert check_session_name("x" * 256)


# What ``str.strip``, ``str.splitlines`` or HTTP treat specially, and a few to be kept.
TRICKY = "xy:% \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f\x85\xa0\u1680\u2003\u2028\u2029\u200b\u3000\ufeff"


@given(st.text(st.sampled_from(TRICKY) | st.characters(), max_size=12))
def test_an_accepted_name_is_one_nothing_would_change_or_split(name: str) -> None:
    try:
        accepted = check_session_name(name)
    except InvalidSessionName:
        return
    assert accepted is name
    assert name.strip() == name
    assert name.splitlines() == [name]
    assert name.encode("utf-8").decode("utf-8") == name


@given(
    st.text(st.sampled_from(TRICKY), max_size=4),
    st.text(max_size=4),
    st.text(st.sampled_from(TRICKY), max_size=4),
)
def test_distinct_accepted_names_never_share_a_key(before: str, core: str, after: str) -> None:
    names = {name for name in (core, before + core + after) if _accepted(name)}
    keys = {build_session_key(SessionSource("api", chat_id=n, user_id=n)) for n in names}
    assert len(keys) == len(names)


def _accepted(name: str) -> bool:
    try:
        check_session_name(name)
    except InvalidSessionName:
        return False
    return True
