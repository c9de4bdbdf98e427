"""Reading the deploy YAML: a loader that refuses duplicate keys, deep nesting, scalars their tag cannot read and
numbers not written in plain decimal, naming the file and the key path. Reading each mapping's keys:
:mod:`.deploy_section`."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any, Callable

import yaml

from .deploy_errors import ConfigError, quote
from .deploy_numbers import DECIMAL, NotDecimal, decimal_only

# Far deeper than the seed file's six levels (scalars counted). PyYAML composes and builds nodes recursively, so a
# document nested a few hundred levels deep would end in a RecursionError instead of a message.
MAX_DEPTH = 32
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
        what = "" if isinstance(exc, NotDecimal) else "not valid YAML: "  # valid YAML, read as the writer did not mean
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


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)
for _name in ("bool", "int", "float", "timestamp"):
    _tag = f"tag:yaml.org,2002:{_name}"
    _construct = yaml.SafeLoader.yaml_constructors[_tag]
    _Loader.add_constructor(_tag, _checked(decimal_only(_name, _construct) if _name in DECIMAL else _construct))
