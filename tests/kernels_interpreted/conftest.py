"""The project's Triton kernels on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1).

tests/test_kernels_interpreted.py runs this folder in a child pytest with TRITON_INTERPRET=1 and Triton on the path;
without that variable the folder is not collected, so the interpreter and Triton's import never reach the rest of the
suite. By hand: ``TRITON_INTERPRET=1 PYTHONPATH=.venv/triton-interpret:src python -m pytest tests/kernels_interpreted``.

Triton 3.6's interpreter needs seven fixes to run these kernels as the GPU does. They are applied here, once, before any
kernel is built (the kernel modules build theirs lazily), to this process only, and never change a kernel:

1. A scalar loaded from memory is a one-element array, and ``__index__`` (``range(lo, hi, step)`` on such scalars)
   converts it with ``int()``, which numpy 2.4 refuses for arrays (triton-lang/triton#9171): ``.item()`` instead.
2. The interpreter runs a kernel by re-executing its source at module level, so names the kernel takes from the
   function that built it (``tl``, ``libdevice``, a helper @triton.jit function) are lost: they are put back.
3. ``libdevice`` has no interpreter form: the functions our kernels call map to ``tl.math``'s (numpy, float32).
4. bf16 is held as its uint16 bit pattern, and ``tl.dot`` multiplied those integers (triton-lang/triton#11584): bf16
   operands are widened to float32 first, which is exact, as the GPU's tensor cores multiply them.
5. float32 -> bf16 casts truncated the mantissa; the GPU (``cvt.rn.bf16.f32``) and torch round to nearest even.
6. Elementwise arithmetic and comparisons on bf16 bit patterns raise, instead of computing on the integers.
7. float32 -> e4m3 casts lost the carry of a rounding into the exponent (31.8 became 16); the GPU
   (``cvt.rn.satfinite.e4m3x2.f32``) rounds to nearest even and saturates at 448.

What stays on the GPU: launches with programmatic dependent launch (``gdc_wait``, the inline-PTX L2 prefetch have no
interpreter form; CPU tensors never take PDL), and the quack GEMM of kernels/glu_linear.py, which is not Triton.
"""

from __future__ import annotations

import inspect
import os

import numpy as np
import pytest
import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
collect_ignore_glob = [] if INTERPRETING else ["*.py"]
TRITON_SERIES = "3.6."  # the interpreter internals the fixes replace


def _bf16_to_float32(bits: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16).float().numpy()


def _float32_to_bf16(values: np.ndarray) -> np.ndarray:
    rounded = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(torch.bfloat16)
    return rounded.view(torch.int16).numpy().view(np.uint16)


def _float32_to_e4m3(values: np.ndarray) -> np.ndarray:
    finite = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).clamp(-448.0, 448.0)
    return finite.to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def _fix_interpreter() -> None:
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime import interpreter
    from triton.runtime.interpreter import FunctionRewriter, InterpreterBuilder, TensorHandle

    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_index(tensor, scope):  # 1
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    def compile_and_exec(self, transformed_ast):  # 2: the original's globals, plus the kernel's closure
        code = compile(transformed_ast, filename=self.filename, mode="exec")
        for key, value in vars(interpreter).items():
            self.fn.__globals__.setdefault(key, value)
        namespace = {**self.fn.__globals__, **inspect.getclosurevars(self.fn).nonlocals}
        local = dict(self.kwargs)
        exec(code, namespace, local)
        return local[self.fn.__name__]

    for name in ("exp", "rsqrt"):  # 3: resolved per call, when tl.math holds the interpreter's ops
        setattr(libdevice, name, lambda *args, _name=name: getattr(tl.math, _name)(*args))

    create_dot, cast_impl, binary_op, fp_to_fp = (InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl,
                                                  InterpreterBuilder.binary_op, InterpreterBuilder.create_fp_to_fp)

    def widen(handle):
        return TensorHandle(_bf16_to_float32(handle.data), tl.float32) if handle.dtype.scalar == tl.bfloat16 else handle

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # 4
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    def cast(self, src, dst_type):  # 5
        if (src.dtype.scalar, dst_type.scalar) == (tl.float32, tl.bfloat16):
            return TensorHandle(_float32_to_bf16(src.data), tl.bfloat16)
        if (src.dtype.scalar, dst_type.scalar) == (tl.bfloat16, tl.float32):
            return TensorHandle(_bf16_to_float32(src.data), tl.float32)
        return cast_impl(self, src, dst_type)

    def binary(self, lhs, rhs, op):  # 6
        if tl.bfloat16 in (lhs.dtype.scalar, rhs.dtype.scalar):
            raise NotImplementedError(f"{op.__name__} on bf16 operands: the interpreter would compute on bit patterns")
        return binary_op(self, lhs, rhs, op)

    def float_to_float(self, src, dst_type, rounding_mode):  # 7
        if (src.dtype.scalar, dst_type.scalar) == (tl.float32, tl.float8e4nv):
            if rounding_mode is not None and "RTNE" not in str(rounding_mode).upper():
                raise NotImplementedError(f"e4m3 cast with rounding {rounding_mode}: the fix rounds to nearest even")
            return TensorHandle(_float32_to_e4m3(src.data), tl.float8e4nv)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    interpreter._patch_lang_tensor = patch_tensor_index
    FunctionRewriter._compile_and_exec = compile_and_exec
    InterpreterBuilder.create_dot, InterpreterBuilder.cast_impl, InterpreterBuilder.binary_op = dot, cast, binary
    InterpreterBuilder.create_fp_to_fp = float_to_float


if INTERPRETING:
    import triton

    if triton.__version__.startswith(TRITON_SERIES):
        _fix_interpreter()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not INTERPRETING:
        return
    import triton

    if not triton.__version__.startswith(TRITON_SERIES):
        skip = pytest.mark.skip(reason=f"the interpreter fixes are written for Triton {TRITON_SERIES}x, "
                                       f"found {triton.__version__}")
        for item in items:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def seeded():
    """Each test draws its inputs from the same seed, whatever ran before it."""
    torch.manual_seed(0)
