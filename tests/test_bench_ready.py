"""bench/ready.py: the precisions it builds, and its fresh-process run on the tiny checkpoint (CPU) as on the GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from music3serve.bench.ready import deploy_for
from music3serve.errors import Music3Error

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("precision, dtype, quantization", [
    ("float32", "float32", "none"), ("bfloat16", "bfloat16", "none"), ("fp8", "bfloat16", "fp8")])
def test_each_precision_is_the_default_deploy_file_with_stage_1_in_it(precision, dtype, quantization):
    talker, stage1 = deploy_for(precision).stages
    assert (stage1.precision, stage1.dtype, stage1.quantization) == (precision, dtype, quantization)
    assert (talker.dtype, talker.quantization) == ("bfloat16", quantization)
    with pytest.raises(Music3Error, match="precision must be one of float32, bfloat16, fp8, got 'fp16'"):
        deploy_for("fp16")


def test_the_ready_bench_measures_each_start_in_a_fresh_process(tiny_dir):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "music3serve.bench.ready", "float32", "--warm", "--checkpoint",
                          str(tiny_dir)], capture_output=True, text=True, env=env, timeout=300, check=True)
    assert out.stderr.count("engine ready talker_s=") == 2  # each child's engine logs its parts
    table = out.stdout[out.stdout.rindex("each start in a process of its own"):]
    rows = [line.split("|")[1:-1] for line in table.splitlines() if line.startswith("| float32")]
    assert [row[1].strip() for row in rows] == ["empty", "of the start before"]
    for row in rows:
        ready, talker, renderer, first_audio, song = (float(cell) for cell in row[2:7])
        assert 0 < talker + renderer <= ready and 0 < first_audio <= song
        assert row[7].strip() == "0 / 0"  # nothing is compiled on the CPU (fusion is CUDA's)
        assert row[8].strip() == "0 / 0"  # nor Triton kernels (CUDA's)


def test_compiled_graphs_counts_every_compile():
    """The bench's count of compiled graphs (a compile while a song plays shows as a stall) rises with each new one."""
    from music3serve.bench.common import compiled_graphs

    before = compiled_graphs()
    torch.compile(lambda x: x * 3 + 1, backend="eager", fullgraph=True)(torch.ones(4))
    assert compiled_graphs() == before + 1


def test_kernel_compiles_are_counted_by_kernel_from_the_start_given():
    """Triton's post-compile hook names each kernel it compiled; the bench counts them apart before and after ready."""
    from types import SimpleNamespace

    from music3serve.bench.common import KernelCompiles
    from music3serve.bench.ready import by_ready_and_after

    kernels = KernelCompiles()
    for name in ["split_kernel", "skinny_linear_kernel", "split_kernel", "skinny_linear_kernel"]:  # as Triton names them
        kernels.compiled(fn=SimpleNamespace(name=f"_kernel.<locals>.{name}"), key=(), repr="", compile={},
                         is_manual_warmup=False, already_compiled=False)
    kernels.compiled(fn=SimpleNamespace(name="triton_poi_fused_0"), already_compiled=True)  # inductor's: not ours
    assert kernels.since(0) == {"split_kernel": 2, "skinny_linear_kernel": 2}
    assert kernels.since(3) == {"skinny_linear_kernel": 1}
    assert by_ready_and_after(3, 1, kernels.since(3)) == "3 / 1 (skinny_linear_kernel 1)"
    assert by_ready_and_after(4, 0, {}) == "4 / 0"
