"""Benchmarks on full-size models with random weights (`music3serve bench talker|acoustic`)."""
