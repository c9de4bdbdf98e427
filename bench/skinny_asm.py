"""The skinny decode GEMM (kernels/skinny_linear_kernel.py) compiled offline for Hopper (sm_90), no GPU needed: for a
weight shape, tile and widening, how the weight tile travels and what the main loop executes per iteration.

Per configuration it prints, from Triton's TTGIR and the SASS of its cubin (nvdisasm, shipped with Triton):
the weight tile's path (cp.async into shared memory over how many buffers, TMA, or plain global loads), the shared
memory it takes and the weight bytes those buffers hold, and per thread and loop iteration: conversion instructions
(F2F / F2FP / I2F), other widening arithmetic (integer bit operations, HMUL2), shared-memory loads and stores (LDSM,
LDS, STS) in bytes, MMA instructions (HMMA = mma.sync, HGMMA = wgmma), all instructions per weight element, and the
registers and spilled bytes. The kernel is compiled with the argument specialisation a talker launch gets (pointers
and multiples of 16 marked divisible by 16, `rows` unspecialised), so the pipelining is the GPU's.

    PYTHONPATH=/path/to/triton-3.6:src python bench/skinny_asm.py                    # the talker's weights
    PYTHONPATH=... python bench/skinny_asm.py --shape 4096 4096 --tile 32 512 4 4 --dump out/   # one, files kept
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
from collections import Counter
from pathlib import Path

from music3serve.kernels.skinny_linear import MEASURED_FP8_TILES, tile_config
from music3serve.kernels.skinny_linear_kernel import ROW_TILE, VARIANTS, WIDENINGS, _kernel, _prefetch_lines

TALKER = [(6144, 4096, False), (4096, 4096, False), (24576, 4096, True), (4096, 12288, False), (16385, 4096, False),
          (12288, 4096, False), (12288, 4096, True), (4096, 6144, False), (1024, 4096, False)]
POINTERS = ("x_ptr", "w_ptr", "y_ptr", "residual_ptr", "scale_ptr")
COUNTED = {  # SASS opcode prefix -> column
    "F2F": "cvt", "F2FP": "cvt", "I2F": "cvt", "HMUL2": "hmul2", "HFMA2": "hmul2", "LOP3": "int", "SHF": "int",
    "PRMT": "int", "IMAD.SHL": "int", "IMAD.U32": "int", "IMAD.MOV": "mov", "MOV": "mov", "HMMA": "hmma",
    "HGMMA": "hgmma", "LDGSTS": "ldgsts", "LDG": "ldg", "UTMALDG": "tma",
}


def compile_kernel(n: int, k: int, tile: tuple, fp8: bool, gated: bool = False):
    """The kernel's CompiledKernel for sm_90, as run_kernel launches it (no residual; PDL on)."""
    import triton
    from triton.backends.compiler import GPUTarget

    block_n, block_k, warps, stages, *variant = tile
    widening, k_over_warps = VARIANTS[variant[0] if variant else "cvt"]
    ints = {"rows": ROW_TILE, "n": n // 2 if gated else n, "k": k, "stride_w": k, "stride_x": k,
            "stride_residual": n // 2 if gated else n}
    signature = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv" if fp8 else "*bf16", "y_ptr": "*bf16", "residual_ptr": "*bf16",
                 "scale_ptr": "*fp32", **dict.fromkeys(ints, "i32")}
    constants = dict(BLOCK_M=ROW_TILE, BLOCK_N=block_n, BLOCK_K=block_k, GATED=gated, RESIDUAL=False, SCALED=fp8,
                     WORDS=WIDENINGS[widening] if fp8 else 0, PARTS=warps if k_over_warps else 1, PDL=True,
                     PREFETCH_LINES=_prefetch_lines(block_n), LINE=128 if fp8 else 64)
    signature.update(dict.fromkeys(constants, "constexpr"))
    fn = _kernel()
    divisible = [*POINTERS, *(name for name, value in ints.items() if name != "rows" and value % 16 == 0)]
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    source = triton.compiler.ASTSource(fn, signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages, launch_pdl=True))


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def sass(cubin: bytes, folder: Path) -> tuple[str, str]:
    """(nvdisasm's SASS, cuobjdump's resource usage line) of a cubin."""
    path = folder / "kernel.cubin"
    path.write_bytes(cubin)
    text = subprocess.run([_tool("nvdisasm"), "-c", str(path)], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([_tool("cuobjdump"), "-res-usage", str(path)], capture_output=True, text=True).stdout
    return text, next((line.strip() for line in usage.splitlines() if "REG:" in line), "")


def main_loop(text: str, opcodes: bool = True) -> list[str]:
    """The opcodes (or lines) of the SASS loop over K: from the label a backward branch jumps to, to that branch."""
    lines, labels = text.splitlines(), {}
    for i, line in enumerate(lines):
        if re.match(r"^\.L_x_\d+:", line):
            labels[line.split(":")[0]] = i
        target = re.search(r"BRA `?\(?(\.L_x_\d+)", line)
        if target and target.group(1) in labels:
            body = lines[labels[target.group(1)]:i + 1]
            if not opcodes:
                return body
            return [m.group(1) for m in (re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", b) for b in body) if m]
    return []


def mma_chains(text: str) -> int:
    """Independent accumulator chains among the loop's HMMAs: those whose accumulator input no earlier HMMA of the
    loop wrote (each carries an accumulator over from the previous iteration)."""
    written, chains = set(), 0
    for line in main_loop(text, opcodes=False):
        mma = re.search(r"HMMA\S* (R\d+), R\d+, R\d+, (R\d+)", line)
        if mma:
            chains += mma.group(2) not in written
            written.add(mma.group(1))
    return chains


def shared_bytes(opcode: str) -> int:
    """Bytes a thread moves by one shared-memory load or store opcode."""
    if opcode.startswith("LDSM"):
        return 4 * int(re.search(r"\.(\d)$", opcode).group(1))  # .x4: four 8x8 b16 matrices, 16 bytes a thread
    width = re.search(r"\.(\d+)$", opcode)
    return int(width.group(1)) // 8 if width else 4


def facts(n: int, k: int, tile: tuple, fp8: bool, gated: bool = False, dump: Path | None = None) -> dict:
    """What the compiled kernel does per loop iteration, per thread, for one configuration."""
    import tempfile

    compiled = compile_kernel(n, k, tile, fp8, gated)
    ttgir = compiled.asm["ttgir"]
    with tempfile.TemporaryDirectory() as tmp:
        text, usage = sass(compiled.asm["cubin"], Path(dump or tmp))
    if dump:
        for key in ("ttgir", "ptx"):
            (dump / f"kernel.{key}").write_text(compiled.asm[key])
        (dump / "kernel.sass").write_text(text)
    loop = main_loop(text)
    counts = Counter()
    for op in loop:
        column = next((COUNTED[p] for p in sorted(COUNTED, key=len, reverse=True) if op.startswith(p)), None)
        counts[column] += column is not None
        if op.startswith(("LDS", "STS")):
            counts["lds" if op.startswith("LDS") else "sts"] += shared_bytes(op)
    block_n, block_k, warps = tile[:3]
    elements = block_n * block_k * (2 if gated else 1) / (32 * warps)  # weight elements per thread per iteration
    buffers = [(int(dims.split("x")[0]), math.prod(map(int, dims.split("x")[1:])), dtype) for dims, dtype in
               re.findall(r"local_alloc : \(\) -> !ttg.memdesc<([0-9x]+)x([a-zA-Z]\w*),", ttgir)]
    x_buffer = (ROW_TILE * block_k, "bf16")  # x's tile, allocated first; the others hold w (gate and up)
    weight = [b for i, b in enumerate(buffers) if i != next(j for j, c in enumerate(buffers) if c[1:] == x_buffer)]
    in_flight = sum(stages * size * {"i32": 4, "f8E4M3FN": 1}.get(dtype, 2) for stages, size, dtype in weight)
    regs, local = re.search(r"REG:(\d+)", usage), re.search(r"LOCAL:(\d+)", usage)
    return {
        "weight path": (f"cp.async, {len(weight)} x {weight[0][0]} buffers" if weight and "async_copy_global" in ttgir
                        else "TMA" if counts["tma"] else f"ld.global x{counts['ldg']}"),
        "weight bytes in smem": in_flight, "smem": compiled.metadata.shared,
        "cvt/el": counts["cvt"] / elements, "int/el": counts["int"] / elements, "hmul2/el": counts["hmul2"] / elements,
        "mov/el": counts["mov"] / elements, "lds B/el": counts["lds"] / elements, "sts B": counts["sts"],
        "mma": (f"HMMA x{counts['hmma']}, {mma_chains(text)} chains" if counts["hmma"] else f"HGMMA x{counts['hgmma']}"),
        "instr/el": len(loop) / elements, "regs": int(regs.group(1)) if regs else 0,
        "spill B": int(local.group(1)) if local else 0,
    }


def row_label(n: int, k: int, gated: bool, dtype: str, tile: tuple) -> str:
    return f"[{n}, {k}]{' gated' if gated else ''} {dtype} {tuple(tile)}"


def table(rows: list[tuple[str, dict]]) -> str:
    keys = list(rows[0][1])
    out = ["| weight, dtype, tile | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 1)]
    for label, values in rows:
        cells = [f"{v:.2f}" if isinstance(v, float) else str(v) for v in values.values()]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", type=int, nargs=2, metavar=("N", "K"), help="one weight (default: the talker's)")
    parser.add_argument("--gated", action="store_true")
    parser.add_argument("--tile", type=int, nargs=4, metavar=("BLOCK_N", "BLOCK_K", "WARPS", "STAGES"),
                        help="the e4m3 tile (default: the FP8 table's; bf16 always its own table's)")
    parser.add_argument("--dump", type=Path, help="write kernel.{ttgir,ptx,sass,cubin} of the last row here")
    args = parser.parse_args(argv)
    shapes = [(*args.shape, args.gated)] if args.shape else TALKER
    rows = []
    for n, k, gated in shapes:
        fp8_tile = tuple(args.tile) if args.tile else MEASURED_FP8_TILES.get((n, k, gated), tile_config(n, k, gated, True))
        configs = [("bf16", tile_config(n, k, gated), False)]
        configs += [(f"e4m3 {v}", (*fp8_tile[:4], v), True) for v in VARIANTS]
        for dtype, tile, fp8 in configs:
            if args.dump:
                args.dump.mkdir(parents=True, exist_ok=True)
            rows.append((row_label(n, k, gated, dtype, tile), facts(n, k, tile, fp8, gated, args.dump)))
    print(table(rows))


if __name__ == "__main__":
    main()
