"""Three gateway hosts and a store host, built of network namespaces, lose nothing.

The run (:mod:`tests.multihost.run`, once per store) builds its own hosts:
three namespaces each running ``chatlane serve`` and a fourth running the
store (Redis; PostgreSQL where this chatlane has that store), all on one
private bridge whose root-namespace end is the load generator. It sends
5,000 messages over 200 sessions to random hosts, retrying a failed request
on another host with the same ``Idempotency-Key``; it pulls one host's link out
while that host holds three turns (``hold`` messages) and plugs it back in
once other hosts have taken them over. Each test checks one property of that
run, from the client's answers, the turn log all hosts share, and the store.
Figures are printed; nothing is checked against a clock.
"""

from __future__ import annotations

import pytest

from tests.multihost.checks import max_concurrent, overlaps
from tests.multihost.network import Network
from tests.multihost.run import Run, expected_texts, run_hosts

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def run(store_host: tuple[Network, str], tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One run per store, checked by every test of the module."""
    network, store_url = store_host
    return run_hosts(network, store_url, tmp_path_factory.mktemp("hosts"))


def test_every_message_is_answered_and_committed_exactly_once(run: Run) -> None:
    assert run.results.unanswered == [], f"{len(run.results.unanswered)} messages got no answer"
    for message, answer in run.results.answers.items():
        assert answer.content.startswith(f"reply {message.text} gen="), answer
    assert run.stored == dict.fromkeys(expected_texts(run), 1), "not committed exactly once"


def test_every_answer_comes_from_a_turn_that_kept_its_lease(run: Run) -> None:
    assert run.turns.unended == []
    assert run.turns.pids() == set(run.pids.values())
    live = run.turns.live().items()
    ran = {(key, span.gen, span.pid) for key, spans in live for span in spans}
    for message, answer in run.results.answers.items():
        gen, pid = (int(part.split("=")[1]) for part in answer.content.split()[-2:])
        assert (f"main:api:dm:{message.session}", gen, pid) in ran, answer


def test_turns_that_kept_their_lease_never_overlap_and_their_generations_grow(run: Run) -> None:
    live = run.turns.live()
    assert overlaps(live) == []
    assert {max_concurrent(spans) for spans in live.values()} == {1}


def test_a_host_cut_off_mid_turn_ends_it_before_another_host_takes_over(run: Run) -> None:
    for key in run.held_keys:
        spans = run.turns.spans[key]
        assert max_concurrent(spans) == 1, f"two turns of {key} ran at once: {spans}"


def test_no_turn_starts_after_a_newer_generation_of_its_session(run: Run) -> None:
    for key, spans in run.turns.spans.items():
        gens = [span.gen for span in spans]  # in the order the turns started
        assert gens == sorted(set(gens)), f"{key}: generations {gens}"


def test_turns_held_by_the_cut_off_host_are_taken_over_and_answered_elsewhere(run: Run) -> None:
    cut_off = run.pids[run.plan.flap.name]
    for message in run.plan.held:
        assert run.turns.runs[message.text] >= 2, "the held turn was not taken over"
        assert f" pid={cut_off}" not in run.results.answers[message].content
    assert len(run.turns.stale) >= len(run.plan.held), "a held turn ended as if it held its lease"


def test_the_cut_off_host_fails_requests_then_answers_again(run: Run) -> None:
    outage, flap = run.results.outage, run.plan.flap.name
    assert outage is not None
    assert outage.up > outage.down
    assert any(key.startswith(f"{flap}:") for key in run.results.failures)
    assert any(a.host == flap and a.at > outage.up for a in run.results.answers.values())


def test_every_gateway_stops_cleanly(run: Run) -> None:
    assert run.exits == [0, 0, 0], run.tails
