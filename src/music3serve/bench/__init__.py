"""Benchmarks on full-size models with random weights (`music3serve bench talker|acoustic`), and the precision
harness (precision.py) that measures a policy against float32."""
