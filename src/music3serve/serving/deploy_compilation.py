"""The compilation_config block of a stage: CUDA graph capture sizes and mode; the compilation modes and graph
modes this engine cannot honor are refused with the reason."""

from __future__ import annotations

from .deploy_schema import CompilationConfig
from .deploy_section import Section, is_int

CUDAGRAPH_MODES = ("FULL_DECODE_ONLY", "NONE")
_REFUSED_GRAPH_MODES = {
    "FULL": "prefill steps always run eager here; only the uniform frame step of decoding songs is captured",
    "PIECEWISE": "this engine captures the whole step as one graph and never splits it around attention",
    "FULL_AND_PIECEWISE": "this engine captures the whole step as one graph and never splits it around attention",
}
_REFUSED_COMPILATION_MODES = dict.fromkeys(
    (1, 2, 3), "nothing is compiled here: the steps are our own eager modules, captured as CUDA graphs"
)
_COMPILATION_KEYS = ("mode", "cudagraph_capture_sizes", "cudagraph_mode", "cudagraph_num_of_warmups", "custom_ops")


def parse_compilation(m: Section, limit: int, limit_name: str, pairs: bool, enforce_eager: bool) -> CompilationConfig:
    """The stage `m`'s compilation_config; capture sizes up to `limit` (named `limit_name` in errors), counting rows
    that come in cond/uncond pairs when `pairs`."""
    c = m.sub("compilation_config", _COMPILATION_KEYS)
    mode = c.data.get("mode", 0)
    if not (is_int(mode) and mode == 0):
        reason = _REFUSED_COMPILATION_MODES.get(mode) if is_int(mode) else None
        raise c.bad("mode", mode, "0 (no compilation)" + (f"; refused: {reason}" if reason else ""))
    if "cudagraph_capture_sizes" in c.data:
        sizes = c.data["cudagraph_capture_sizes"]
    elif pairs:  # row counts: powers of two from 2 up to the limit, and the limit (fewer rows replay the next size up)
        sizes = [2**k for k in range(1, limit.bit_length())]
        if limit not in sizes:
            sizes.append(limit)
    else:  # window batches: every size (a batch of a size without a graph runs eagerly)
        sizes = list(range(1, limit + 1))
    allowed = f"a list of distinct integers in [1, {limit_name} = {limit}]"
    if not (isinstance(sizes, list) and all(is_int(s) and 1 <= s <= limit for s in sizes)
            and len(set(sizes)) == len(sizes)):
        raise c.bad("cudagraph_capture_sizes", sizes, allowed)
    graph_mode = c.choice("cudagraph_mode", "FULL_DECODE_ONLY", CUDAGRAPH_MODES, refused=_REFUSED_GRAPH_MODES)
    if pairs and not enforce_eager and graph_mode != "NONE" and not any(s % 2 == 0 for s in sizes):
        raise c.bad("cudagraph_capture_sizes", sizes, f"{allowed} with at least one even size (sizes count rows, "
                    "which come in cond/uncond pairs), or enforce_eager: true")
    warmups = c.int("cudagraph_num_of_warmups", 1, 1, 1, "1 (each capture size runs eagerly once before capture: "
                    "kernel choice and Triton builds must not land inside a graph; the graph builders run exactly one)")
    ops = c.data.get("custom_ops", ["all"])
    if ops not in ([], ["all"]):
        raise c.bad("custom_ops", ops, '["all"] or [] (this engine\'s own kernels are always used where they exist; '
                    '"none" and per-op "+name"/"-name" switches cannot be honored)')
    return CompilationConfig(mode, tuple(sizes), graph_mode, warmups, tuple(ops))
