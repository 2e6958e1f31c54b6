"""The PostgreSQL store's routines: a turn's calls, each one statement and one round trip.

A turn's calls — taking a session's lease (with its message queued, or not) and its
fenced commit (with its lease given back, or not) — each need the session's lock
before they read, then several statements. Sent one by one inside a transaction
they cost five to six round trips; as one call of a function of the store's
schema they cost one, and run in that statement's own transaction. What stays
true:

* Each routine takes the session's advisory lock (``hashtextextended`` of its
  key, as every other transaction of the store does), then reads the server's
  clock; every statement after that sees what the last transaction holding
  the lock committed (``READ COMMITTED``: a fresh snapshot per statement).
* A routine that refuses writes nothing but what the refusal must keep (the
  session's ``waiting`` mark). A commit that would answer a message answered
  within the retention raises ``CLA01`` with the message ids (a JSON array) as
  its detail, so its whole statement rolls back.
* Each routine pins ``search_path`` to the schema it was created in.
* The definitions here are schema steps, written out whole, sharing no text with
  the store's other statements (:mod:`~chatlane.stores.postgres.schema`):
  once shipped they are never edited. A change is a new step that replaces a
  routine (``CREATE OR REPLACE FUNCTION``).
"""

from __future__ import annotations

__all__ = ["ALREADY_ANSWERED", "STEP_5", "STEP_7"]

ALREADY_ANSWERED = "CLA01"
"""The SQLSTATE a commit raises when a message it answers was answered within the
retention; its detail is the JSON array of those message ids."""

_RECORD_DELIVERIES = """CREATE FUNCTION chatlane_record_deliveries(
    p_ids text[], p_lanes text[], p_targets text[], p_payloads bytea[],
    p_moment float8, p_lock text, p_locked text[]
) RETURNS void LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    v_target text;
BEGIN
    FOREACH v_target IN ARRAY p_locked LOOP  -- the targets' locks, in the order given
        PERFORM pg_advisory_xact_lock(hashtextextended(p_lock || v_target, 0));
    END LOOP;
    INSERT INTO deliveries (id, lane, target, payload, created_at)
    SELECT i, l, t, p, p_moment
    FROM unnest(p_ids, p_lanes, p_targets, p_payloads) WITH ORDINALITY AS x(i, l, t, p, n)
    ORDER BY n
    ON CONFLICT (id) DO NOTHING;
END $$"""
"""Record each delivery not recorded before, in order, as pending and due at ``p_moment``,
once the locks of ``p_locked`` (the targets, sorted) are held."""

_ADMIT = """CREATE FUNCTION chatlane_admit(
    p_key text, p_holder text, p_ttl float8, p_head bigint, p_max_active bigint,
    p_token text, p_chosen text, p_read boolean, p_active_lock text,
    p_message_id text, p_payload bytea,
    OUT o_moment float8, OUT o_seq bigint, OUT o_busy boolean, OUT o_earlier boolean,
    OUT o_live bigint, OUT o_generation bigint, OUT o_names text[], OUT o_values text[],
    OUT o_own_holder text, OUT o_own_generation bigint, OUT o_own_expires float8
) LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_key, 0));
    o_moment := extract(epoch FROM clock_timestamp());
    o_seq := p_head;
    IF p_message_id IS NOT NULL THEN
        INSERT INTO pending (key, message_id, owner, payload, accepted_at)
        VALUES (p_key, p_message_id, p_holder, p_payload, o_moment)
        ON CONFLICT (message_id) DO NOTHING RETURNING seq INTO o_seq;
        IF o_seq IS NULL THEN  -- queued already: nothing was written
            SELECT seq INTO o_seq FROM pending WHERE message_id = p_message_id;
        END IF;
    END IF;
    IF p_max_active > 0 THEN
        PERFORM pg_advisory_xact_lock(hashtextextended('chatlane-active:' || p_active_lock, 0));
    END IF;
    WITH checked AS (SELECT
        EXISTS (SELECT 1 FROM leases WHERE key = p_key AND expires_at > o_moment) AS busy,
        o_seq IS NOT NULL AND EXISTS (
            SELECT 1 FROM pending WHERE key = p_key AND seq < o_seq AND owner <> p_holder
        ) AS earlier,
        CASE WHEN p_max_active > 0
            THEN (SELECT count(*) FROM leases WHERE expires_at > o_moment) ELSE 0 END AS live
    ), taken AS (
        INSERT INTO leases (key, holder, token, generation, expires_at)
        SELECT p_key, p_holder, p_chosen,
            coalesce((SELECT generation FROM sessions WHERE key = p_key), 0) + 1,
            o_moment + p_ttl
        FROM checked WHERE NOT busy AND NOT earlier AND (p_max_active = 0 OR live < p_max_active)
        ON CONFLICT (key) DO UPDATE SET holder = excluded.holder, token = excluded.token,
            generation = excluded.generation, expires_at = excluded.expires_at
        WHERE leases.expires_at <= o_moment
        RETURNING generation
    ), bumped AS (
        INSERT INTO sessions (key, generation) SELECT p_key, generation FROM taken
        ON CONFLICT (key) DO UPDATE SET generation = excluded.generation
        RETURNING generation
    ), waits AS (
        INSERT INTO sessions (key, waiting) SELECT p_key, true FROM checked WHERE busy OR earlier
        ON CONFLICT (key) DO UPDATE SET waiting = true WHERE NOT sessions.waiting
    )
    SELECT busy, earlier, live, (SELECT generation FROM bumped),
        CASE WHEN p_read THEN (SELECT coalesce(array_agg(field ORDER BY position), '{}')
            FROM persistent WHERE key = p_key) END,
        CASE WHEN p_read THEN (SELECT coalesce(array_agg(value ORDER BY position), '{}')
            FROM persistent WHERE key = p_key) END
    INTO o_busy, o_earlier, o_live, o_generation, o_names, o_values
    FROM checked;
    IF o_busy AND p_token <> '' THEN  -- the live lease may be the caller's own
        SELECT holder, generation, expires_at INTO o_own_holder, o_own_generation, o_own_expires
        FROM leases WHERE key = p_key AND token = p_token AND expires_at > o_moment;
    END IF;
END $$"""
"""Queue ``p_message_id`` (unless NULL; its ``seq`` then is the head to check), then take
``p_key``'s lease with its next generation for ``p_holder`` if nothing refuses: a live
lease, another holder's message queued before the head, or ``p_max_active`` live leases
(counted under one store-wide lock). A refusal marks the session ``waiting`` when it is
busy, so its next release notifies; a live lease carrying ``p_token`` is returned as the
caller's. With ``p_read``, the persistent fields as the statement reads them."""

_COMMIT = """CREATE FUNCTION chatlane_commit(
    p_key text, p_generation bigint, p_new_conversation text,
    p_answer text, p_answered text[], p_retention float8,
    p_entry_conversations text[], p_roles text[], p_contents text[], p_generations bigint[],
    p_message_ids text[], p_times float8[], p_attachments bytea[],
    p_fields text[], p_values text[], p_done bigint[], p_token text,
    p_channel text, p_notice text, p_title text, p_rename boolean,
    p_delivery_ids text[], p_lanes text[], p_targets text[], p_payloads bytea[],
    p_target_lock text, p_locked_targets text[],
    OUT o_current bigint, OUT o_freed boolean
) LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    v_moment float8;
    v_conversation text;
    v_marked text[];
    v_repeated text[];
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_key, 0));
    v_moment := extract(epoch FROM clock_timestamp());
    o_freed := false;
    SELECT generation, current_conversation INTO o_current, v_conversation
    FROM sessions WHERE key = p_key;
    o_current := coalesce(o_current, 0);
    IF p_generation IS NOT NULL AND p_generation <> o_current THEN
        RETURN;  -- fenced off: nothing written
    END IF;
    IF coalesce(v_conversation, '') = '' THEN
        v_conversation := p_new_conversation;
        INSERT INTO conversations (id, key, started_at, title)
        VALUES (v_conversation, p_key, v_moment, '');
        INSERT INTO sessions (key, current_conversation) VALUES (p_key, v_conversation)
        ON CONFLICT (key) DO UPDATE SET current_conversation = excluded.current_conversation;
    END IF;
    WITH marked AS (
        INSERT INTO answered (message_id, at, answer)
        SELECT m, v_moment, p_answer FROM unnest(p_answered) m
        ON CONFLICT (message_id) DO UPDATE SET at = excluded.at, answer = excluded.answer
        WHERE answered.at <= v_moment - p_retention
        RETURNING message_id
    ), appended AS (
        INSERT INTO transcript (conversation_id, entry_conversation, role, content, generation,
            message_id, created_at, attachments)
        SELECT v_conversation, nullif(nullif(e, ''), v_conversation), r, c, g, m,
            CASE WHEN t = 0 THEN v_moment ELSE t END, a
        FROM unnest(p_entry_conversations, p_roles, p_contents, p_generations, p_message_ids,
            p_times, p_attachments) WITH ORDINALITY AS x(e, r, c, g, m, t, a, n)
        ORDER BY n
    ), fields AS (
        INSERT INTO persistent (key, field, value)
        SELECT p_key, f, v FROM unnest(p_fields, p_values) WITH ORDINALITY AS x(f, v, n)
        ORDER BY n
        ON CONFLICT (key, field) DO UPDATE SET value = excluded.value
    ), dropped AS (
        DELETE FROM pending WHERE key = p_key AND seq = ANY(p_done) RETURNING 1
    ), freed AS (
        DELETE FROM leases WHERE key = p_key AND token = p_token RETURNING 1
    ), titled AS (
        UPDATE conversations SET title = p_title
        WHERE p_title <> '' AND id = v_conversation AND (p_rename OR title = '')
    ), woken AS (
        UPDATE sessions SET waiting = false
        WHERE key = p_key AND waiting
            AND (EXISTS (SELECT 1 FROM freed) OR EXISTS (SELECT 1 FROM dropped))
        RETURNING pg_notify(p_channel, p_notice)
    )
    SELECT array(SELECT message_id FROM marked), EXISTS (SELECT 1 FROM freed)
    INTO v_marked, o_freed;
    v_repeated := ARRAY(SELECT m FROM unnest(p_answered) m WHERE NOT m = ANY(v_marked));
    IF cardinality(v_repeated) > 0 THEN  -- the whole statement rolls back
        RAISE EXCEPTION 'already answered' USING
            ERRCODE = 'CLA01', DETAIL = array_to_json(v_repeated)::text;
    END IF;
    IF cardinality(p_delivery_ids) > 0 THEN
        PERFORM chatlane_record_deliveries(p_delivery_ids, p_lanes, p_targets, p_payloads,
            v_moment, p_target_lock, p_locked_targets);
    END IF;
END $$"""
"""The fenced commit: if ``p_key``'s generation is not ``p_generation`` (unless NULL),
nothing is written and ``o_current`` says what it is. Otherwise, the session's current
conversation started if it has none (as ``p_new_conversation``), then every write in one
statement: the answered marks (one within the retention is kept, which rolls everything
back), the transcript entries in order, the persistent fields, the done records, the lease
carrying ``p_token`` (if any) freed, the conversation titled (if it has no title, or the
batch renames it), and — if a lease was freed or a record done while someone waits for the
session — its waiters woken; then the deliveries recorded."""

STEP_5: tuple[str, ...] = (_RECORD_DELIVERIES, _ADMIT, _COMMIT)
"""Schema step 5: the routines as first shipped."""

_ADMIT_7 = """CREATE OR REPLACE FUNCTION chatlane_admit(
    p_key text, p_holder text, p_ttl float8, p_head bigint, p_max_active bigint,
    p_token text, p_chosen text, p_read boolean, p_active_lock text,
    p_message_id text, p_payload bytea,
    OUT o_moment float8, OUT o_seq bigint, OUT o_busy boolean, OUT o_earlier boolean,
    OUT o_live bigint, OUT o_generation bigint, OUT o_names text[], OUT o_values text[],
    OUT o_own_holder text, OUT o_own_generation bigint, OUT o_own_expires float8
) LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_key, 0));
    o_moment := extract(epoch FROM clock_timestamp());
    o_seq := p_head;
    IF p_message_id IS NOT NULL THEN
        INSERT INTO pending (key, message_id, owner, payload, accepted_at)
        VALUES (p_key, p_message_id, p_holder, p_payload, o_moment)
        ON CONFLICT (message_id) DO NOTHING RETURNING seq INTO o_seq;
        IF o_seq IS NULL THEN  -- queued already: nothing was written
            SELECT seq INTO o_seq FROM pending WHERE message_id = p_message_id AND key = p_key;
            IF o_seq IS NULL THEN  -- by another session: refused, nothing written
                RETURN;
            END IF;
        END IF;
    END IF;
    IF p_max_active > 0 THEN
        PERFORM pg_advisory_xact_lock(hashtextextended('chatlane-active:' || p_active_lock, 0));
    END IF;
    WITH checked AS (SELECT
        EXISTS (SELECT 1 FROM leases WHERE key = p_key AND expires_at > o_moment) AS busy,
        o_seq IS NOT NULL AND EXISTS (
            SELECT 1 FROM pending WHERE key = p_key AND seq < o_seq AND owner <> p_holder
        ) AS earlier,
        CASE WHEN p_max_active > 0
            THEN (SELECT count(*) FROM leases WHERE expires_at > o_moment) ELSE 0 END AS live
    ), taken AS (
        INSERT INTO leases (key, holder, token, generation, expires_at)
        SELECT p_key, p_holder, p_chosen,
            coalesce((SELECT generation FROM sessions WHERE key = p_key), 0) + 1,
            o_moment + p_ttl
        FROM checked WHERE NOT busy AND NOT earlier AND (p_max_active = 0 OR live < p_max_active)
        ON CONFLICT (key) DO UPDATE SET holder = excluded.holder, token = excluded.token,
            generation = excluded.generation, expires_at = excluded.expires_at
        WHERE leases.expires_at <= o_moment
        RETURNING generation
    ), bumped AS (
        INSERT INTO sessions (key, generation) SELECT p_key, generation FROM taken
        ON CONFLICT (key) DO UPDATE SET generation = excluded.generation
        RETURNING generation
    ), waits AS (
        INSERT INTO sessions (key, waiting) SELECT p_key, true FROM checked WHERE busy OR earlier
        ON CONFLICT (key) DO UPDATE SET waiting = true WHERE NOT sessions.waiting
    )
    SELECT busy, earlier, live, (SELECT generation FROM bumped),
        CASE WHEN p_read THEN (SELECT coalesce(array_agg(field ORDER BY position), '{}')
            FROM persistent WHERE key = p_key) END,
        CASE WHEN p_read THEN (SELECT coalesce(array_agg(value ORDER BY position), '{}')
            FROM persistent WHERE key = p_key) END
    INTO o_busy, o_earlier, o_live, o_generation, o_names, o_values
    FROM checked;
    IF o_busy AND p_token <> '' THEN  -- the live lease may be the caller's own
        SELECT holder, generation, expires_at INTO o_own_holder, o_own_generation, o_own_expires
        FROM leases WHERE key = p_key AND token = p_token AND expires_at > o_moment;
    END IF;
END $$"""
"""``chatlane_admit`` as step 5 made it, but a message another session's queued message
holds the id of is refused: nothing is written, and ``o_seq`` (with everything but
``o_moment``) is NULL."""

_COMMIT_7 = """CREATE FUNCTION chatlane_commit(
    p_key text, p_generation bigint, p_new_conversation text,
    p_answer text, p_answered text[], p_retention float8,
    p_entry_conversations text[], p_roles text[], p_contents text[], p_generations bigint[],
    p_message_ids text[], p_times float8[], p_attachments bytea[],
    p_fields text[], p_values text[], p_done bigint[], p_token text,
    p_channel text, p_notice text, p_title text, p_rename boolean,
    p_delivery_ids text[], p_lanes text[], p_targets text[], p_payloads bytea[],
    p_target_lock text, p_locked_targets text[], p_failure text,
    OUT o_current bigint, OUT o_freed boolean
) LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
DECLARE
    v_moment float8;
    v_conversation text;
    v_marked text[];
    v_repeated text[];
BEGIN
    PERFORM pg_advisory_xact_lock(hashtextextended(p_key, 0));
    v_moment := extract(epoch FROM clock_timestamp());
    o_freed := false;
    SELECT generation, current_conversation INTO o_current, v_conversation
    FROM sessions WHERE key = p_key;
    o_current := coalesce(o_current, 0);
    IF p_generation IS NOT NULL AND p_generation <> o_current THEN
        RETURN;  -- fenced off: nothing written
    END IF;
    IF coalesce(v_conversation, '') = '' THEN
        v_conversation := p_new_conversation;
        INSERT INTO conversations (id, key, started_at, title)
        VALUES (v_conversation, p_key, v_moment, '');
        INSERT INTO sessions (key, current_conversation) VALUES (p_key, v_conversation)
        ON CONFLICT (key) DO UPDATE SET current_conversation = excluded.current_conversation;
    END IF;
    WITH marked AS (
        INSERT INTO answered (message_id, at, answer, key, failure)
        SELECT m, v_moment, p_answer, p_key, p_failure FROM unnest(p_answered) m
        ON CONFLICT (message_id) DO UPDATE SET at = excluded.at, answer = excluded.answer,
            key = excluded.key, failure = excluded.failure
        WHERE answered.at <= v_moment - p_retention
        RETURNING message_id
    ), appended AS (
        INSERT INTO transcript (conversation_id, entry_conversation, role, content, generation,
            message_id, created_at, attachments)
        SELECT v_conversation, nullif(nullif(e, ''), v_conversation), r, c, g, m,
            CASE WHEN t = 0 THEN v_moment ELSE t END, a
        FROM unnest(p_entry_conversations, p_roles, p_contents, p_generations, p_message_ids,
            p_times, p_attachments) WITH ORDINALITY AS x(e, r, c, g, m, t, a, n)
        ORDER BY n
    ), fields AS (
        INSERT INTO persistent (key, field, value)
        SELECT p_key, f, v FROM unnest(p_fields, p_values) WITH ORDINALITY AS x(f, v, n)
        ORDER BY n
        ON CONFLICT (key, field) DO UPDATE SET value = excluded.value
    ), dropped AS (
        DELETE FROM pending WHERE key = p_key AND seq = ANY(p_done) RETURNING 1
    ), freed AS (
        DELETE FROM leases WHERE key = p_key AND token = p_token RETURNING 1
    ), titled AS (
        UPDATE conversations SET title = p_title
        WHERE p_title <> '' AND id = v_conversation AND (p_rename OR title = '')
    ), woken AS (
        UPDATE sessions SET waiting = false
        WHERE key = p_key AND waiting
            AND (EXISTS (SELECT 1 FROM freed) OR EXISTS (SELECT 1 FROM dropped))
        RETURNING pg_notify(p_channel, p_notice)
    )
    SELECT array(SELECT message_id FROM marked), EXISTS (SELECT 1 FROM freed)
    INTO v_marked, o_freed;
    v_repeated := ARRAY(SELECT m FROM unnest(p_answered) m WHERE NOT m = ANY(v_marked));
    IF cardinality(v_repeated) > 0 THEN  -- the whole statement rolls back
        RAISE EXCEPTION 'already answered' USING
            ERRCODE = 'CLA01', DETAIL = array_to_json(v_repeated)::text;
    END IF;
    IF cardinality(p_delivery_ids) > 0 THEN
        PERFORM chatlane_record_deliveries(p_delivery_ids, p_lanes, p_targets, p_payloads,
            v_moment, p_target_lock, p_locked_targets);
    END IF;
END $$"""
"""``chatlane_commit`` as step 5 made it, with ``p_failure``: each answered mark keeps the
session (``p_key``) and why its turn failed ("" if it was answered). Beside step 5's, which
a process of an earlier version still calls (its marks keep neither: both read as "")."""

STEP_7: tuple[str, ...] = (
    """ALTER TABLE answered ADD COLUMN key text COLLATE "C" NOT NULL DEFAULT '',
        ADD COLUMN failure text NOT NULL DEFAULT ''""",
    _ADMIT_7,
    _COMMIT_7,
)
"""Schema step 7: an answered mark keeps its session and its turn's failure; a message
whose id another session's queued message holds is refused when it is queued."""
