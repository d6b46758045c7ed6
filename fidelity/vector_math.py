"""A thread's first MKL vector-math call, warmed up before torch splits one over threads."""
from __future__ import annotations

import threading

import torch

# torch's CPU exp, log, sin, cos, tanh, erf, sqrt, ... of contiguous tensors call MKL's vector math (VML), which sets
# itself up on first use. When that first use is a call torch splits over OpenMP threads, one thread's share was now and
# then computed at about fp16 accuracy: the first exp of a [4, 49152] tensor had relative error 1.5e-4 instead of 6e-8
# on exactly the calling thread's half, in ~1 of 36 fresh processes under load. So a process's first rope tables (layer
# 0 then differed with equal input) or first log-sum-exp (2.67e-5 off) differed from every later one. A first call on
# WARM_UP_ELEMENTS runs on the calling thread alone (torch splits unary ops from 2048 elements on).
WARM_UP_ELEMENTS = 1024
VECTOR_MATH_OPS = (torch.exp, torch.expm1, torch.log, torch.log1p, torch.log2, torch.log10, torch.sin, torch.cos,
                   torch.tan, torch.tanh, torch.erf, torch.erfc, torch.sqrt)
_warmed = threading.local()


def warm_up_vector_math() -> None:
    """Call each of torch's VML-backed CPU functions once on this thread alone, in float32 and float64 (once per
    thread: the oracle's forward and head and `metrics.topk_logprobs` call it, for any thread they run on)."""
    if getattr(_warmed, "done", False):
        return
    x = torch.linspace(0.25, 0.75, WARM_UP_ELEMENTS)
    for dtype in (torch.float32, torch.float64):
        for op in VECTOR_MATH_OPS:
            op(x.to(dtype))
    _warmed.done = True
