"""The MMA helper of the bf16 backward kernels.

Triton's CPU interpreter (TRITON_INTERPRET=1, used by CI) stores bf16 as raw uint16 and gets
bf16 ``tl.dot`` and bf16 arithmetic wrong, so under the interpreter the kernels upcast MMA
operands to fp32 first. On the GPU the operands stay bf16 (tensor cores, fp32 accumulate); the
products are exact in fp32 either way, so both paths compute the same math.
"""

import triton
import triton.language as tl


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b with fp32 accumulation; UPCAST feeds fp32 operands (interpreter only)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)
