"""Names, restricted ACLs, errors and escaping through the CLI, against a real redis-server.

Names ``.``, ``..`` and a leading ``-`` are refused; ``stats`` under a restricted ACL
shows Redis's refusal instead of "0 entries"; user data (resource IDs, group names, errors)
reaches the terminal escaped: no rich markup crash, no raw escape sequences; bad input is a
one-line error with a non-zero exit, never a traceback.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from click.testing import Result
from typer.testing import CliRunner

from eventbus import EventBus, Settings
from eventbus.cli import app
from eventbus.dlq import dead_letter_fields
from eventbus.errors import InvalidName
from eventbus.protocol.codec import Envelope, encode_entry
from eventbus.protocol.keys import Keys

RUNNER = CliRunner(env={"COLUMNS": "200"})
EVIL = ["evil[/x]", "[bold]loud[/bold]", "esc\x1b[31mred\x1b[0m", "cr\rline", "bidi\u202eevil"]


def _one_line_error(result: Result, text: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert text in lines[0], result.output


def _publish(url: str, topic: str = "orders", rid: str = "r") -> None:
    out = RUNNER.invoke(
        app, ["publish", topic, "--type", "T", "--resource-id", rid, "--redis-url", url]
    )
    assert out.exit_code == 0, out.output


# -- 7: names ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [".", "..", "-x", "--x"])
def test_dot_names_and_leading_dashes_are_refused(name: str) -> None:
    bus = EventBus(Settings(redis_url="redis://127.0.0.1:1/0"))
    with pytest.raises(InvalidName, match="invalid topic name"):
        bus.topic(name)
    with pytest.raises(InvalidName, match="invalid group name"):
        bus.subscriber("orders", group=name)


@pytest.mark.parametrize("name", [".", ".."])
def test_cli_refuses_dot_topics(redis_db: str, name: str) -> None:
    result = RUNNER.invoke(
        app, ["publish", name, "--type", "T", "--resource-id", "r", "--redis-url", redis_db]
    )
    _one_line_error(result, "invalid topic name")
    with redis.Redis.from_url(redis_db) as r:
        assert r.dbsize() == 0


# -- 10: stats under an ACL -------------------------------------------------------------------
@pytest.fixture
def limited_url(redis_db: str) -> Iterator[str]:
    """A user that may read the coordination keys (the topic registry) but no shard stream."""
    with redis.Redis.from_url(redis_db) as r:
        r.acl_setuser(
            "limited",
            enabled=True,
            passwords=["+limited-pw"],
            keys=["eventbus:{eventbus}:*"],
            commands=["+@all"],
        )
    base = redis_db.removeprefix("redis://")
    yield f"redis://limited:limited-pw@{base}"
    with redis.Redis.from_url(redis_db) as r:
        r.acl_deluser("limited")


def test_stats_shows_an_acl_refusal(redis_db: str, limited_url: str) -> None:
    _publish(redis_db)
    result = RUNNER.invoke(app, ["stats", "--redis-url", limited_url])
    _one_line_error(result, "NoPermissionError: this user has no permissions")
    assert "XINFO" in result.output and "limited-pw" not in result.output
    # the same command as the default user still works and counts the entry
    ok = RUNNER.invoke(app, ["stats", "--redis-url", redis_db])
    assert ok.exit_code == 0, ok.output
    row = next(line for line in ok.output.splitlines() if "orders" in line)
    assert [c.strip() for c in row.replace("│", "|").split("|") if c.strip()][:3] == [
        "orders",
        "16",
        "1",
    ]


# -- 13: escaping -----------------------------------------------------------------------------
def _dead_letter(r: redis.Redis, keys: Keys, rid: str, error: str, **extra: bytes) -> None:
    original = encode_entry(Envelope(rid, "T", b"\1" * 16, 0, {}, {"n": 1}))
    fields = dead_letter_fields(
        topic="orders",
        group="billing",
        shard=0,
        entry_id="1-0",
        reason="failed",
        exc=RuntimeError(error),
        attempts=1,
        original=original,
    )
    r.xadd(keys.dead_letter("orders", "billing"), {**fields, **extra})


def _safe(output: str) -> None:
    assert "\x1b" not in output and "\r" not in output and "\u202e" not in output


def test_dlq_list_escapes_resource_ids_and_errors(redis_db: str) -> None:
    _publish(redis_db)
    keys = Keys()
    with redis.Redis.from_url(redis_db) as r:
        for rid in EVIL:
            _dead_letter(r, keys, rid, f"boom {rid}")
        r.hset(keys.parked("orders", "billing"), mapping={rid: "1-0" for rid in EVIL})
    result = RUNNER.invoke(app, ["dlq", "list", "orders", "billing", "--redis-url", redis_db])
    assert result.exit_code == 0, result.output
    _safe(result.output)
    assert "evil[/x]" in result.output and "[bold]loud[/bold]" in result.output
    assert "esc\\x1b[31mred" in result.output and "bidi\\x202eevil" in result.output


def test_show_tail_and_stats_escape_user_data(redis_db: str) -> None:
    for rid in EVIL:
        _publish(redis_db, rid=rid)
    keys = Keys()
    with redis.Redis.from_url(redis_db) as r:
        _dead_letter(r, keys, EVIL[2], "x\x1b]0;title\x07")
        dlq_id = r.xrange(keys.dead_letter("orders", "billing"))[0][0].decode()
        r.xgroup_create(keys.stream("orders", 0), "grp\x1b[2J[red]", id="0", mkstream=True)
    url = ["--redis-url", redis_db]
    for args in (["dlq", "show", "orders", "billing", dlq_id], ["tail", "orders"], ["stats"]):
        result = RUNNER.invoke(app, [*args, *url])
        assert result.exit_code == 0, (args, result.output)
        _safe(result.output)
    stats = RUNNER.invoke(app, ["stats", *url]).output
    assert "grp\\x1b[2J[red]" in stats


def test_tail_and_dlq_show_print_no_reply_key(redis_db: str) -> None:
    """A request of an older eventbus carries its reply's MAC secret in ``eventbus-reply-key``:
    ``tail`` and ``dlq show`` print it as ``***`` (they printed it)."""
    secret = "5e" * 32
    headers = {"eventbus-reply-key": secret, "trace": "t1"}
    _publish(redis_db)  # registers the topic
    keys = Keys()
    with redis.Redis.from_url(redis_db) as r:
        r.xadd(keys.stream("orders", 0), encode_entry(Envelope("r", "T", b"\1" * 16, 0, headers)))
        original = encode_entry(Envelope("r", "T", b"\1" * 16, 0, headers, {"n": 1}))
        fields = dead_letter_fields(
            topic="orders",
            group="billing",
            shard=0,
            entry_id="1-0",
            reason="failed",
            exc=RuntimeError("boom"),
            attempts=1,
            original=original,
        )
        dlq_id = r.xadd(keys.dead_letter("orders", "billing"), fields).decode()
    url = ["--redis-url", redis_db]
    for args in (["dlq", "show", "orders", "billing", dlq_id], ["tail", "orders"]):
        result = RUNNER.invoke(app, [*args, *url])
        assert result.exit_code == 0, (args, result.output)
        assert secret not in result.output, args
        assert '"eventbus-reply-key": "***"' in result.output and "t1" in result.output, args


# -- 15: one-line errors ----------------------------------------------------------------------
def test_invalid_json_data_is_one_line(redis_db: str) -> None:
    result = RUNNER.invoke(
        app,
        [
            "publish",
            "t",
            "--type",
            "T",
            "--resource-id",
            "r",
            "--data",
            "{bad",
            "--redis-url",
            redis_db,
        ],
    )
    _one_line_error(result, "--data is not valid JSON")


def test_run_of_a_missing_module_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    _one_line_error(RUNNER.invoke(app, ["run", "nonexistent:bus"]), "no module named 'nonexistent'")
    (tmp_path / "notabus.py").write_text("bus = 42\n")
    _one_line_error(RUNNER.invoke(app, ["run", "notabus:bus"]), "is not an EventBus")
    _one_line_error(RUNNER.invoke(app, ["run", "nocolon"]), "expected module:attribute")


@pytest.mark.parametrize(
    "url", ["garbage", "redis://:pa/ss@host/0", "http://x:1/0", "redis://h:99999/0"]
)
@pytest.mark.parametrize("command", [["stats"], ["tail", "t"], ["dlq", "list", "t", "g"]])
def test_a_garbage_redis_url_is_one_line(url: str, command: list[str]) -> None:
    result = RUNNER.invoke(app, [*command, "--redis-url", url])
    _one_line_error(result, "invalid Redis URL")
    assert "pa/ss" not in result.output


def test_replay_of_dotdot_is_one_line(tmp_path: Path) -> None:
    result = RUNNER.invoke(app, ["replay", "..", "--store", str(tmp_path), "--no-progress"])
    _one_line_error(result, "invalid topic name")


def test_a_malformed_dead_letter_is_shown_not_a_traceback(redis_db: str) -> None:
    _publish(redis_db)
    keys = Keys()
    with redis.Redis.from_url(redis_db) as r:
        r.xadd(keys.dead_letter("orders", "billing"), {"shard": "abc", "attempts": "x"})
        _dead_letter(r, keys, "fine", "boom")
        bad_id = r.xrange(keys.dead_letter("orders", "billing"))[0][0].decode()
    url = ["--redis-url", redis_db]
    listed = RUNNER.invoke(app, ["dlq", "list", "orders", "billing", *url])
    assert listed.exit_code == 0, listed.output
    assert "malformed" in listed.output and "fine" in listed.output
    shown = RUNNER.invoke(app, ["dlq", "show", "orders", "billing", bad_id, *url])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["problems"]
    requeued = RUNNER.invoke(app, ["dlq", "requeue", "orders", "billing", bad_id, *url])
    _one_line_error(requeued, "is malformed")


# -- data printed as it is, pipes, unknown groups ----------------------------
def test_dlq_list_prints_colons_in_data_as_they_are(redis_db: str) -> None:
    """rich turned ``:id:`` into an emoji (``user:id:42`` printed as "user🆔42")."""
    _publish(redis_db)
    with redis.Redis.from_url(redis_db) as r:
        _dead_letter(r, Keys(), "user:id:42", "failed on :thumbs_up: and :smile:")
    result = RUNNER.invoke(app, ["dlq", "list", "orders", "billing", "--redis-url", redis_db])
    assert result.exit_code == 0, result.output
    assert "user:id:42" in result.output and ":thumbs_up:" in result.output


def test_dlq_list_of_an_unknown_group_is_an_error(redis_db: str) -> None:
    """A typo in the group listed nothing, as if nothing had failed."""
    _publish(redis_db)
    with redis.Redis.from_url(redis_db) as r:
        r.xgroup_create(Keys().stream("orders", 0), "billing", id="0", mkstream=True)
    result = RUNNER.invoke(app, ["dlq", "list", "orders", "biling", "--redis-url", redis_db])
    _one_line_error(result, "no consumer group 'biling' on topic 'orders' (its groups: billing)")
    known = RUNNER.invoke(app, ["dlq", "list", "orders", "billing", "--redis-url", redis_db])
    assert known.exit_code == 0, known.output


def test_tail_into_a_pipe_closed_early_exits_quietly(redis_db: str) -> None:
    """``eventbus tail ... | head -1``: the reader leaves; no BrokenPipeError, exit code 0."""
    import subprocess
    import sys

    with redis.Redis.from_url(redis_db) as r:  # more output than a pipe's 64 KiB buffer
        data = encode_entry(Envelope("r", "T", b"\1" * 16, 0, {}, {"text": "x" * 300}))
        pipe = r.pipeline(transaction=False)
        for _ in range(1000):
            pipe.xadd(Keys().stream("orders", 0), data)
        pipe.execute()
    _publish(redis_db)  # registers the topic
    tail = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "eventbus.cli",
            "tail",
            "orders",
            "--count",
            "1000",
            "--redis-url",
            redis_db,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert tail.stdout is not None and tail.stderr is not None
    assert tail.stdout.readline()
    tail.stdout.close()  # as `head -1` does after its line
    err = tail.stderr.read().decode()
    assert tail.wait(timeout=60) == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


# -- docwalk32: the README's dlq commands, followed by hand ----------------------------------
@pytest.mark.parametrize("command", ["requeue", "drop"])
def test_dlq_requeue_and_drop_need_ids_or_a_resource_not_both(redis_db: str, command: str) -> None:
    """Without dead-letter IDs or ``--resource`` the command did nothing and printed ``[]``
    (or ``0``) with exit code 0; with both it ignored the IDs."""
    _publish(redis_db)
    keys = Keys()
    with redis.Redis.from_url(redis_db) as r:
        _dead_letter(r, keys, "o-1", "boom")
        dlq_id = r.xrange(keys.dead_letter("orders", "billing"))[0][0].decode()
    url = ["--redis-url", redis_db]
    neither = RUNNER.invoke(app, ["dlq", command, "orders", "billing", *url])
    _one_line_error(neither, f"dlq {command}: give dead-letter IDs or --resource R")
    both = [dlq_id, "--resource", "o-1"]
    _one_line_error(
        RUNNER.invoke(app, ["dlq", command, "orders", "billing", *both, *url]), "not both"
    )
    with redis.Redis.from_url(redis_db) as r:
        assert r.xlen(keys.dead_letter("orders", "billing")) == 1  # nothing was done
        assert not r.exists(keys.parked("orders", "billing"))
    done = RUNNER.invoke(app, ["dlq", command, "orders", "billing", dlq_id, *url])
    assert done.exit_code == 0, done.output
    with redis.Redis.from_url(redis_db) as r:
        assert r.xlen(keys.dead_letter("orders", "billing")) == 0


def test_dlq_list_shows_a_parked_letter_s_error_without_a_leading_colon(redis_db: str) -> None:
    """A ``parked`` letter has no error type: its error column read ": resource is parked"."""
    _publish(redis_db)
    keys = Keys()
    fields = dead_letter_fields(
        topic="orders",
        group="billing",
        shard=0,
        entry_id="1-0",
        reason="parked",
        exc=None,
        attempts=0,
        original=encode_entry(Envelope("o-1", "T", b"\1" * 16, 0, {}, {"n": 1})),
    )
    with redis.Redis.from_url(redis_db) as r:
        r.xadd(keys.dead_letter("orders", "billing"), fields)
    result = RUNNER.invoke(app, ["dlq", "list", "orders", "billing", "--redis-url", redis_db])
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if "o-1" in line)
    assert [c.strip() for c in row.split("│") if c.strip()][-1] == "resource is parked"


def test_offload_with_invalid_settings_is_one_line(tmp_path: Path) -> None:
    """A setting pydantic refuses (the tier's or Redis's) printed a rich traceback."""
    args = ["offload", "--once", "--store", str(tmp_path)]
    bad_tier = RUNNER.invoke(app, args, env={"EVENTBUS_TIER_TYPED_MODELS": '{"orders": 5}'})
    _one_line_error(bad_tier, "typed_models.orders")
    bad_redis = RUNNER.invoke(app, args, env={"EVENTBUS_SHARDS": "0"})
    _one_line_error(bad_redis, "shards")


def test_offload_once_without_redis_is_one_line(tmp_path: Path) -> None:
    """``eventbus offload --once`` with Redis down printed redis-py's ConnectionError as a
    280-line rich traceback; the other commands say it in one line."""
    url = "redis://u:secret@127.0.0.1:1/0"  # nothing listens on port 1
    args = ["offload", "--once", "--store", str(tmp_path), "--redis-url", url]
    result = RUNNER.invoke(app, args)
    _one_line_error(result, "cannot reach Redis at redis://u:***@127.0.0.1:1/0")
    assert "secret" not in result.output


@pytest.mark.parametrize("processes", ["1", "2"])
def test_run_on_a_metrics_port_in_use_names_the_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, processes: str
) -> None:
    """``eventbus run --metrics-port`` on a taken port said only "OSError: [Errno 98] Address
    already in use": not which port, nor what to change. One process, or the parent of
    several (which serves before any child starts)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "svc.py").write_text("from eventbus import EventBus\n\nbus = EventBus()\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["run", "svc:bus", "--processes", processes, "--metrics-port", str(port)]
        result = RUNNER.invoke(app, args)
    _one_line_error(result, f"--metrics-port {port}: cannot serve the metrics on 127.0.0.1:{port}")
    assert "in use" in result.output and "pick another port with --metrics-port" in result.output


def test_offload_on_a_metrics_port_in_use_is_one_line(tmp_path: Path) -> None:
    """``eventbus offload --metrics-port`` on a taken port printed an 80-line traceback."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = ["offload", "--once", "--store", str(tmp_path), "--metrics-port", str(port)]
        result = RUNNER.invoke(app, args)
    _one_line_error(result, f"--metrics-port {port}: ")
    assert "in use" in result.output
