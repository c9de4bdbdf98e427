"""Reading the deploy YAML: a loader that refuses duplicate keys, deep nesting, scalars their tag cannot read and
numbers not written in plain decimal, naming the key path; and typed reads of one mapping at a time whose errors name
the file, the key path, the value (quoted at a bounded length) and what is allowed."""

from __future__ import annotations

import math
import re
import reprlib
from importlib import resources
from pathlib import Path
from typing import Any, Callable

import yaml

from ..errors import Music3Error
from .deploy_schema import SEED_LIMIT

_UNKNOWN_KEY_HINTS = {
    "input_connectors": " (stage 0 takes its requests from the API server; only stage 1 has input_connectors)",
    "output_connectors": " (stage 1 is the last stage: its PCM goes to the API server; only stage 0 has them)",
    "extra_args": " (only stage 0 has extra_args; stage 1's guidance is fixed by the checkpoint)",
}
# Far deeper than the seed file's six levels (scalars counted). PyYAML composes and builds nodes recursively, so a
# document nested a few hundred levels deep would end in a RecursionError instead of a message.
MAX_DEPTH = 32


class ConfigError(Music3Error, ValueError):
    """A deploy configuration that cannot be served as written."""


class _Quote(reprlib.Repr):
    """repr() of a config value cut to a few hundred characters, built without walking more than it shows: anchors
    and aliases let a small file hold a list whose full repr would take gigabytes (a "billion laughs")."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother = 2, 80, 80
        self.maxlist = self.maxtuple = self.maxset = self.maxfrozenset = self.maxdict = 6

    def repr_int(self, x: int, level: int) -> str:
        # repr() of a huge int takes quadratic time, and past 4300 digits raises (YAML reads hex without that limit)
        if x.bit_length() <= 128:
            return repr(x)
        return f"<an integer of about {int(x.bit_length() * math.log10(2))} digits>"


quote = _Quote().repr


MAX_CONFIG_BYTES = 1 << 20  # a deploy YAML is a few KB; a file past this is not one (and would parse for minutes)


def read_deploy_yaml(path: Path | str | None) -> tuple[Any, str]:
    """The loaded document of a deploy YAML and the name errors give it; None reads default_deploy.yaml."""
    if path == "":  # Path("") is the current folder: an error about reading "." would not say what went wrong
        raise ConfigError("'' (an empty path): cannot read the deploy config: the path is empty; leave it out for "
                          "the built-in default")
    if path is None:
        file = resources.files(__package__).joinpath("default_deploy.yaml")
        source = f"{file} (built-in default)"
    else:
        file, source = Path(path), str(path)
    try:
        with file.open("rb") as stream:  # at most one byte past the limit: /dev/zero ends here too
            data = stream.read(MAX_CONFIG_BYTES + 1)
        text = data.decode("utf-8")
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path, or text that is not UTF-8
        raise ConfigError(f"{source}: cannot read the deploy config: {exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{source}: the deploy config is over {MAX_CONFIG_BYTES} bytes (one is a few KB)")
    loader = None
    try:
        loader = _Loader(text, source)  # its reader refuses control characters here already
        return loader.get_single_data(), source
    except yaml.YAMLError as exc:
        where = loader.key_path(exc) if loader is not None else ""
        what = "" if isinstance(exc, _NotDecimal) else "not valid YAML: "  # valid YAML, read as the writer did not mean
        raise ConfigError(f"{source}: {where}{what}{exc}") from None
    finally:
        if loader is not None:
            loader.dispose()


class _Loader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping (PyYAML would keep the last silently), nesting
    deeper than MAX_DEPTH, scalars its tag cannot read and numbers in YAML 1.1's other notations; it remembers each
    node's key path to name it in errors."""

    def __init__(self, text: str, source: str):
        super().__init__(text)
        self.name = source  # marks in YAML errors name the file, not "<unicode string>"
        self.path: list[str] = []  # the steps to the node being composed
        self.paths: dict[int, tuple[str, ...]] = {}  # the steps to each node, by where it starts in the text
        self.checked: set[int] = set()  # the mapping nodes whose keys were checked for duplicates (by id)

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if len(self.path) >= MAX_DEPTH:
            raise yaml.composer.ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels (at "
                                              f"{_joined(self.path)})", self.peek_event().start_mark)
        self.path.append(_step(index))
        try:
            if not self.check_event(yaml.AliasEvent):  # an alias's node has its path already
                self.paths.setdefault(self.peek_event().start_mark.index, tuple(self.path))
            return super().compose_node(parent, index)
        finally:
            self.path.pop()

    def key_path(self, exc: yaml.YAMLError) -> str:
        """'path: ' of the node a construction error is about, or '' (a syntax error stands between nodes)."""
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        steps = self.paths.get(mark.index) if mark else None
        return "" if steps is None else f"{_joined(steps) or '<top level>'}: "

    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        # Here, so that the mappings a merge key copies from are checked too; once, on the pairs as written (a
        # flattened mapping holds a merged key beside the one that overrides it).
        if id(node) not in self.checked:
            self.checked.add(id(node))
            _refuse_duplicates(self, node)
        super().flatten_mapping(node)
        # PyYAML before 6.0.4 copies a merged mapping's pairs once per alias to it, so merges of merges grow
        # exponentially. A key node belongs to one pair, so its copies are the same pair: keep the last, which wins.
        last = {id(key): i for i, (key, _) in enumerate(node.value)}
        node.value = [pair for i, pair in enumerate(node.value) if last[id(pair[0])] == i]


def _step(index: Any) -> str:
    """compose_node's index as a step of a key path: a position in a sequence, or the key node of a mapping value
    (None for a key, which takes its mapping's path)."""
    if isinstance(index, int):
        return f"[{index}]"
    if isinstance(index, yaml.ScalarNode):
        return f".{index.value}"
    return "" if index is None else ".?"  # a key that is a list or mapping: construct_mapping refuses it


def _joined(steps: list[str] | tuple[str, ...]) -> str:
    return "".join(steps).lstrip(".")


def _refuse_duplicates(loader: _Loader, node: yaml.MappingNode) -> None:
    """A key written twice in one mapping, the merge key '<<' included, is an error (PyYAML keeps the last)."""
    seen: set[Any] = set()
    merges = 0
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            merges += 1
            if merges > 1:
                raise yaml.constructor.ConstructorError(None, None, "duplicate key '<<' (merge several mappings in "
                                                        "one: <<: [*a, *b])", key_node.start_mark)
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            duplicate = key in seen
            seen.add(key)
        except TypeError:  # unhashable: construct_mapping reports it
            continue
        if duplicate:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {quote(key)}", key_node.start_mark)


def _mapping(loader: _Loader, node: yaml.Node, deep: bool = False) -> dict:
    """A mapping, its keys checked by flatten_mapping (!!map on a scalar or a list: construct_mapping refuses it)."""
    return loader.construct_mapping(node, deep=deep)


def _checked(construct: Callable[[_Loader, yaml.Node], Any]) -> Callable[[_Loader, yaml.Node], Any]:
    """A scalar constructor whose failures on bad text are YAML errors at the scalar: PyYAML's own raise KeyError
    (!!bool maybe), IndexError (!!int ""), AttributeError (!!timestamp foo) or ValueError (an int over 4300 digits)."""

    def checked(loader: _Loader, node: yaml.Node) -> Any:
        try:
            return construct(loader, node)
        except (LookupError, AttributeError, ValueError) as exc:
            detail = f" ({exc})" if isinstance(exc, ValueError) else ""
            tag = node.tag.rpartition(":")[2]
            raise yaml.constructor.ConstructorError(None, None, f"cannot read {quote(node.value)} as !!{tag}{detail}",
                                                    node.start_mark) from None

    return checked


class _NotDecimal(yaml.constructor.ConstructorError):
    """A number YAML reads, but not written in plain decimal."""


# Integers as JSON writes them; floats too, or YAML's own .inf and .nan (the typed reads refuse those, saying what
# is allowed). YAML 1.1 reads a leading zero as octal (010 is 8), d:dd as base 60 (1:30 is 90), and takes 0x, 0b,
# a '+', '_' between digits, and floats such as .5 or 1. without a digit on one side of the dot.
_INT = r"-?(?:0|[1-9][0-9]*)"
_DECIMAL = {
    "int": re.compile(_INT),
    "float": re.compile(rf"{_INT}(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)"),
}


def _decimal(kind: str, construct: Callable[[_Loader, yaml.Node], Any]) -> Callable[[_Loader, yaml.Node], Any]:
    """An int or float constructor that refuses the number read unless its text is plain decimal (after reading, so
    text the tag cannot read at all gets _checked's message)."""

    def decimal(loader: _Loader, node: yaml.Node) -> Any:
        value = construct(loader, node)
        if not _DECIMAL[kind].fullmatch(node.value):
            raise _NotDecimal(None, None, _not_decimal(kind, node.value, value), node.start_mark)
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


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)
for _name in ("bool", "int", "float", "timestamp"):
    _tag = f"tag:yaml.org,2002:{_name}"
    _construct = yaml.SafeLoader.yaml_constructors[_tag]
    _Loader.add_constructor(_tag, _checked(_decimal(_name, _construct) if _name in _DECIMAL else _construct))


def bad(source: str, path: str, value: Any, allowed: str) -> ConfigError:
    return ConfigError(f"{source}: {path}: got {quote(value)}; allowed: {allowed}")


def is_int(v: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    """A finite int or float that is not a bool."""
    return is_int(v) or (isinstance(v, float) and math.isfinite(v))  # isfinite() overflows on a 400-digit int


class Section:
    """One mapping of the file: typed reads with defaults, after refusing keys not in `keys`."""

    def __init__(self, data: Any, path: str, source: str, keys: tuple[str, ...]):
        self.path, self.source = path, source
        if not isinstance(data, dict):
            raise bad(source, path or "<top level>", data, f"a mapping with the keys {', '.join(keys)}")
        for key in data:
            if key not in keys:
                hint = _UNKNOWN_KEY_HINTS.get(key, "") if isinstance(key, str) else ""
                raise ConfigError(f"{source}: {self.key(key)}: unknown key{hint}; allowed here: {', '.join(keys)}")
        self.data = data

    def key(self, key: Any) -> str:
        """The key's path from the top of the file."""
        text = key if isinstance(key, str) else quote(key)  # str() refuses an int of over 4300 digits
        return f"{self.path}.{text}" if self.path else text

    def bad(self, key: str, value: Any, allowed: str) -> ConfigError:
        return bad(self.source, self.key(key), value, allowed)

    def sub(self, key: str, keys: tuple[str, ...]) -> Section:
        """The mapping under ``key`` (empty when missing), allowing ``keys``."""
        return Section(self.data.get(key, {}), self.key(key), self.source, keys)

    def bool(self, key: str, default: bool, refuse_true: str = "") -> bool:
        """True or false; with ``refuse_true``, only false (the reason given is ``refuse_true``)."""
        v = self.data.get(key, default)
        if not isinstance(v, bool) or (v and refuse_true):
            raise self.bad(key, v, f"false ({refuse_true})" if refuse_true else "true or false")
        return v

    def int(self, key: str, default: int, lo: int, hi: float = math.inf, allowed: str = "", even: bool = False) -> int:
        v = self.data.get(key, default)
        if not (is_int(v) and lo <= v <= hi and not (even and v % 2)):
            span = f"an integer >= {lo}" if hi == math.inf else f"an integer in [{lo}, {hi}]"
            raise self.bad(key, v, (allowed or span) + (_int_text_hint(v) if isinstance(v, str) else ""))
        return v

    def number(self, key: str, default: float, ok: Any, allowed: str) -> float:
        """A finite number for which ``ok`` holds, as a float."""
        v = self.data.get(key, default)
        if not (is_number(v) and ok(v)):
            if isinstance(v, str) and _reads_as_number(v):  # YAML 1.1 takes 5e-1 (no dot), 1.0e3 and -.5 for text
                how = ("with a dot" if "." not in v else "with a sign in its exponent" if re.search("[eE][0-9]", v)
                       else "in decimal")
                allowed += f"; {quote(v)} was read as text: write it {how}, as {yaml_float(float(v))}"
            raise self.bad(key, v, allowed)
        return float(v)

    def choice(self, key: str, default: str, choices: tuple[str, ...], why: str = "", refused: dict | None = None
               ) -> str:
        """One of ``choices``; ``refused`` gives the reason some other known values cannot be honored."""
        v = self.data.get(key, default)
        if not (isinstance(v, str) and v in choices):
            reason = (refused or {}).get(v) if isinstance(v, str) else None
            why = f" ({why})" if why else ""
            raise self.bad(key, v, " or ".join(choices) + why + (f"; refused: {reason}" if reason else ""))
        return v

    def seed(self, key: str, default: int | None) -> int | None:
        v = self.data.get(key, default)
        if v is not None and not (is_int(v) and 0 <= v < SEED_LIMIT):
            raise self.bad(key, v, "null or an integer in [0, 2**64)")
        return v


def _int_text_hint(text: str) -> str:
    """Why an integer in a notation YAML 1.1 does not read was read as text: 0o10 (YAML 1.2's octal) and 08 (a
    leading zero, but not octal)."""
    if re.fullmatch(r"[-+]?0[oO][0-7_]+", text):
        return f"; {quote(text)} was read as text (YAML 1.1 has no 0o): write integers in decimal"
    if re.fullmatch(r"[-+]?0[0-7_]*[89][0-9_]*", text):  # quoted "010" is just a string
        return (f"; {quote(text)} was read as text (YAML 1.1 reads a leading zero as octal, and it is not): write "
                "integers in decimal, without leading zeros")
    return ""


def _reads_as_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False
