"""Numbers in the deploy YAML: the plain decimal notation the loader takes, and for a number in another notation
(read as YAML 1.1 reads it, or read as text) what is wrong with it and how to write it instead."""

from __future__ import annotations

import math
import re
from typing import Any, Callable

import yaml

from .deploy_errors import quote


class NotDecimal(yaml.constructor.ConstructorError):
    """A number YAML reads, but not written in plain decimal."""


# Integers as JSON writes them; floats too, or YAML's own .inf and .nan (the typed reads refuse those, saying what
# is allowed). YAML 1.1 reads a leading zero as octal (010 is 8), d:dd as base 60 (1:30 is 90), and takes 0x, 0b,
# a '+', '_' between digits, and floats such as .5 or 1. without a digit on one side of the dot.
_INT = r"-?(?:0|[1-9][0-9]*)"
DECIMAL = {
    "int": re.compile(_INT),
    "float": re.compile(rf"{_INT}(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)"),
}


def decimal_only(kind: str, construct: Callable[[yaml.SafeLoader, yaml.Node], Any]
                 ) -> Callable[[yaml.SafeLoader, yaml.Node], Any]:
    """An int or float constructor that refuses the number read unless its text is plain decimal (after reading, so
    text the tag cannot read at all gets the loader's message for that)."""

    def decimal(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
        value = construct(loader, node)
        if not DECIMAL[kind].fullmatch(node.value):
            raise NotDecimal(None, None, _not_decimal(kind, node.value, value), node.start_mark)
        return value

    return decimal


def _not_decimal(kind: str, text: str, value: Any) -> str:
    """What is wrong with a number's text and how to write it instead (what YAML made of octal or base 60 is shown,
    not offered: 010 may have meant 10)."""
    digits = text.lstrip("+-").lower()
    read = f"YAML 1.1 reads it as {quote(value)}"
    if kind == "float":
        offer = f", as {yaml_float(value)}" if math.isfinite(value) else ""
    else:
        offer = f", as {value}" if value.bit_length() <= 128 else ""  # str() refuses an int of over 4300 digits
    if ":" in text:
        how, then = f"is written in base 60 ({read})", ""
    elif kind == "int" and digits.startswith(("0x", "0b")):
        how, then = f"is written in {'hexadecimal' if digits[1] == 'x' else 'binary'} ({read})", offer
    elif kind == "int" and digits.startswith("0"):
        how, then = f"has a leading zero, so {read} (octal)", ", without leading zeros"
    elif "_" in text:
        how, then = f"has '_' in it ({read})", offer
    elif text.startswith("+"):
        how, then = "has a '+' sign", offer
    elif digits.startswith("."):
        how, then = "has no digit before its dot", offer
    elif re.search(r"\.(?![0-9])", text):
        how, then = "has no digit after its dot", offer
    elif re.match(r"0[0-9]", digits):
        how, then = "has a leading zero", offer
    else:
        how, then = f"is not written in plain decimal ({read})", offer
    return f"{quote(text)} {how}: write {'integers' if kind == 'int' else 'numbers'} in decimal{then}"


def yaml_float(x: float) -> str:
    """A finite float as a deploy YAML can hold it: YAML 1.1 reads an exponent only after a dot (1.0e+300, where
    repr() writes 1e+300)."""
    text = repr(x)
    mantissa, e, exponent = text.partition("e")
    return f"{mantissa}.0e{exponent}" if e and "." not in mantissa else text


def int_text_hint(text: str) -> str:
    """Why an integer in a notation YAML 1.1 does not read was read as text: 0o10 (YAML 1.2's octal) and 08 (a
    leading zero, but not octal)."""
    if re.fullmatch(r"[-+]?0[oO][0-7_]+", text):
        return f"; {quote(text)} was read as text (YAML 1.1 has no 0o): write integers in decimal"
    if re.fullmatch(r"[-+]?0[0-7_]*[89][0-9_]*", text):  # quoted "010" is just a string
        return (f"; {quote(text)} was read as text (YAML 1.1 reads a leading zero as octal, and it is not): write "
                "integers in decimal, without leading zeros")
    return ""


def reads_as_number(text: str) -> bool:
    """Text that float() reads as a finite number."""
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False
