"""Structured log lines: one event per line, key=value pairs that parse back."""

from __future__ import annotations

import logging
import re
import sys

from music3serve.logs import KeyValueFormatter, setup_logging

PAIR = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def test_values_with_spaces_quotes_and_line_breaks_parse_back():
    record = logging.makeLogRecord({"msg": "song failed", "song": "s1", "samples": 0, "gone": None, "took": 1.23456,
                                    "error": 'stage 0 failed: "out of memory" samples=7\nnext line \\ end'})
    line = KeyValueFormatter("%(message)s").format(record)
    assert "\n" not in line and "gone=" not in line
    fields = {k: v for k, v in PAIR.findall(line)}
    assert fields["song"] == "s1" and fields["samples"] == "0" and fields["took"] == "1.235"
    error = fields["error"][1:-1].encode().decode("unicode_escape")
    assert error == 'stage 0 failed: "out of memory" samples=7\nnext line \\ end'


# Where str.splitlines() breaks besides \n and \r (the first test has those), and other control characters.
BREAKERS = "\t\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029\x1b\x00"


def test_every_line_breaking_or_control_character_is_escaped_in_values_and_message():
    """An id from the Python API may hold any character; each event must still be one line (a value with U+2028 or
    a vertical tab used to go out raw, and a message with a line feed as two lines)."""
    text = f"a{BREAKERS}b é ♪"
    record = logging.makeLogRecord({"msg": f"multi\nline {BREAKERS}", "song": text})
    line = KeyValueFormatter("%(message)s").format(record)
    assert len(line.splitlines()) == 1 and all(c not in line for c in BREAKERS + "\n")
    assert line.startswith("multi\\nline \\t\\x0b\\x0c\\x1c\\x1d\\x1e\\x85\\u2028\\u2029\\x1b\\x00 song=")
    value = dict(PAIR.findall(line))["song"]
    assert value.startswith('"') and value.endswith('"') and "é ♪" in value  # printable text is left as it is
    assert value[1:-1].replace("é ♪", "").encode().decode("unicode_escape") == text.replace("é ♪", "")


def test_a_traceback_keeps_its_lines():
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.makeLogRecord({"msg": "failed", "exc_info": sys.exc_info()})
    lines = KeyValueFormatter("%(message)s").format(record).splitlines()
    assert lines[0] == "failed" and lines[-1] == "ValueError: boom" and len(lines) > 2


def test_lines_are_stamped_in_utc_iso_8601_with_milliseconds():
    """The stamp was local time without a zone, and its space split it into two fields."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        setup_logging("INFO")
        record = logging.makeLogRecord({"msg": "song ended", "name": "music3serve.x", "levelname": "INFO",
                                        "created": 86400.25, "msecs": 250.0, "song": "s1"})
        line = root.handlers[0].format(record)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert line == "1970-01-02T00:00:00.250Z INFO music3serve.x song ended song=s1"


def test_private_attributes_other_libraries_add_to_records_stay_out_of_the_line():
    """Ray's log record factory stamps every record with `_ray_timestamp_ns`; under `serve --ray` it went out as a
    field of every line. Names with a leading underscore are no extra field of ours."""
    record = logging.makeLogRecord({"msg": "song ended", "song": "s1", "_ray_timestamp_ns": 1796414858876678354})
    assert KeyValueFormatter("%(message)s").format(record) == "song ended song=s1"


def test_the_handler_writes_to_the_stderr_of_the_moment(monkeypatch):
    """A server thread logging after stderr was swapped and the old stream closed (pytest's capture between tests)
    raised 'I/O operation on closed file' in logging; the handler follows sys.stderr instead."""
    import io

    setup_logging()
    handler = logging.getLogger().handlers[0]
    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    logging.getLogger("music3serve.test").info("one")
    first.close()
    monkeypatch.setattr(sys, "stderr", second)
    logging.getLogger("music3serve.test").info("two")
    assert handler.stream is second and second.getvalue().rstrip().endswith("two")
