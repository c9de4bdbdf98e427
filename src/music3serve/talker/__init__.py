"""Stage 0: the autoregressive talker (language model + depth decoder)."""
