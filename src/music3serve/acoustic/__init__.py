"""Stage 1: the acoustic renderer (condition encoder, flow-matching DiT, vocoder)."""
