"""Numbers pinned by the MiniMax-Music3 checkpoint; changing any of them changes the audio."""

from __future__ import annotations

# Special token ids of the checkpoint's tokenizer.
IM_START = 151644
IM_END = 151645
AUDIO_CFG = 151654
AUDIO_START = 151669
AUDIO_END = 151670
CAPTION_START = 151671
CAPTION_END = 151672
LYRICS_START = 151673
LYRICS_END = 151674
AUDIO_CODE_OFFSET = 151675  # semantic code k is token AUDIO_CODE_OFFSET + k

SPECIAL_TOKENS: dict[str, int] = {
    "<|im_start|>": IM_START,
    "<|im_end|>": IM_END,
    "<|audio_cfg|>": AUDIO_CFG,
    "<|audio_start|>": AUDIO_START,
    "<|audio_end|>": AUDIO_END,
    "<|caption_start|>": CAPTION_START,
    "<|caption_end|>": CAPTION_END,
    "<|lyrics_start|>": LYRICS_START,
    "<|lyrics_end|>": LYRICS_END,
}

# Vocabulary and codebooks.
LM_VOCAB_SIZE = 200_000
SEMANTIC_CODES = 16_384
LEGAL_COLUMNS = SEMANTIC_CODES + 1  # audio_end + every semantic code
NUM_CODEBOOKS = 8  # semantic c0 + seven residual codebooks c1..c7
RESIDUAL_CODES = 1024

# Prompt and budget limits.
MAX_PROMPT_TOKENS = 5_000
# The shortest prompt: the template's 7 special tokens, the lyrics' "[start" and "]\n", and one token of lyrics text
# (a caption may clean away to nothing, e.g. "---"). A context must hold it and a frame to serve any song.
MIN_PROMPT_TOKENS = 10
MAX_FRAMES = 9_000
MAX_CONTEXT = 10_240
MAX_DURATION_S = 360.0
# The model names official clients send (OpenAI's `model`): the model's own and its Hugging Face repository's.
SERVED_MODEL_NAMES = ("MiniMax-Music3", "MiniMaxAI/MiniMax-Music3")
SEED_LIMIT = 2**64  # seeds are unsigned 64-bit: every bit keys the sampler's and the DiT noise's draws

# Stage 0 sampling recipe.
AR_CFG_SCALE = 1.5
AR_CFG_TOP_K = 50
AR_TOP_K = 50

# Rates.
FRAME_RATE = 25  # 24000 Hz / 960 hop: one frame is 40 ms
SAMPLE_RATE = 44_100
LATENT_HOP = 512  # waveform samples per latent column
LATENT_CHANNELS = 128

# Stage 1 windows and flow matching.
WINDOW_FRAMES = 200
WINDOW_HOP = 100
OVERLAP_LATENT = 172
CROP_LEFT_LATENT = 86
CROP_RIGHT_LATENT = 2 * OVERLAP_LATENT - CROP_LEFT_LATENT  # 258
DIT_STEPS = 30
DIT_CFG_SCALE = 1.7
NOISE_PROMPT_EPS = 1e-6


def is_seed(value: object) -> bool:
    """A Python int in [0, SEED_LIMIT) (not a bool, float or numpy integer): two different ones draw different songs."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < SEED_LIMIT


def latent_length(frames: int) -> int:
    """Latent columns for a run of frames, with the checkpoint's float arithmetic order."""
    return max(1, int(frames * SAMPLE_RATE / 24000 * 960 / LATENT_HOP))


def window_starts(frames: int) -> list[int]:
    """Frame index where each 200-frame window begins."""
    if frames <= WINDOW_FRAMES:
        return [0]
    return list(range(0, frames - WINDOW_HOP, WINDOW_HOP))


def window_frames(frames: int, start: int) -> int:
    """Frames covered by the window that begins at `start`."""
    return min(start + WINDOW_FRAMES, frames) - start


def frame_budget(requested: int, prompt_tokens: int, context: int = MAX_CONTEXT) -> int:
    """Frames a song may have: the request, the 9000-frame cap, and what fits in the context after the prompt."""
    return min(requested, MAX_FRAMES, context - prompt_tokens)
