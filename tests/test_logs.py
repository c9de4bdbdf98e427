"""Structured log lines: one event per line, key=value pairs that parse back."""

from __future__ import annotations

import logging
import re

from music3serve.logs import KeyValueFormatter

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
