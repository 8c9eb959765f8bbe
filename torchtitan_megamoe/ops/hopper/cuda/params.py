"""The launch parameter structs of csrc/include/launch_params.h as ctypes Structures.

Each extern "C" entry point of csrc/ takes a pointer to one of these; the field names, C types
and order mirror the header exactly (tests/hopper/test_launch_params.py checks it), so a field
added on one side only fails in CI, not as a corrupt launch. Pointers travel as integers
(``tensor.data_ptr()``) or None.
"""

from __future__ import annotations

import ctypes

_P, _I, _LL = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong


class Gemm1SwigluParams(ctypes.Structure):
    _fields_ = [
        ("x", _P), ("w1", _P), ("w3", _P), ("h", _P), ("a", _P),
        ("row_slot", _P), ("tile_expert", _P), ("num_rows_used", _P),
        ("E", _I), ("H", _I), ("D", _I), ("top_k", _I), ("plan_bm", _I), ("group_m", _I),
        ("stride_x", _LL), ("stride_h", _LL), ("stride_a", _LL), ("rows", _LL),
        ("num_sms", _I), ("ticket", _P), ("stream", _P),
    ]


class Fp8Gemm1SwigluParams(ctypes.Structure):
    _fields_ = [
        ("x", _P), ("stride_x", _LL), ("x_scale", _P), ("stride_xs", _LL),
        ("w1", _P), ("w1_scale", _P), ("w3", _P), ("w3_scale", _P),
        ("stride_bse", _LL), ("stride_bsn", _LL),
        ("hq", _P), ("hs", _P), ("a", _P),
        ("row_slot", _P), ("tile_expert", _P), ("num_rows_used", _P),
        ("E", _I), ("H", _I), ("D", _I), ("top_k", _I), ("plan_bm", _I), ("group_m", _I),
        ("x_rows", _LL), ("num_sms", _I), ("stream", _P),
    ]


class GemmRowsParams(ctypes.Structure):
    _fields_ = [
        ("inp", _P), ("w", _P), ("w2", _P), ("out", _P),
        ("row_slot", _P), ("tile_expert", _P), ("num_rows_used", _P),
        ("E", _I), ("N", _I), ("K", _I), ("k_split", _I), ("n_major", _I), ("plan_bm", _I),
        ("group_m", _I), ("rows", _LL), ("num_sms", _I), ("ticket", _P), ("stream", _P),
    ]


class Fp8GemmRowsParams(ctypes.Structure):
    _fields_ = [
        ("a", _P), ("a_scale", _P), ("stride_as", _LL),
        ("b", _P), ("b_scale", _P), ("stride_bse", _LL), ("stride_bsn", _LL),
        ("out", _P), ("tile_expert", _P), ("num_rows_used", _P), ("seg_start", _P),
        ("expert_base", _I), ("E", _I), ("N", _I), ("K", _I), ("plan_bm", _I), ("group_m", _I),
        ("rows", _LL), ("num_sms", _I), ("stream", _P),
    ]


class Dgrad2SwigluParams(ctypes.Structure):
    _fields_ = [
        ("dy", _P), ("stride_dy", _LL), ("w2", _P), ("a", _P), ("da", _P), ("hw", _P),
        ("dy_rows", _P), ("part", _P), ("topk_w", _P),
        ("row_slot", _P), ("tile_expert", _P), ("num_rows_used", _P),
        ("E", _I), ("D", _I), ("H", _I), ("top_k", _I), ("plan_bm", _I),
        ("rows", _LL), ("num_sms", _I), ("ticket", _P), ("stream", _P),
    ]


class Fp8Dgrad2SwigluParams(ctypes.Structure):
    _fields_ = [
        ("dy", _P), ("stride_dy", _LL), ("dy_scale", _P), ("stride_dys", _LL),
        ("w2t", _P), ("w2t_scale", _P), ("stride_bse", _LL), ("stride_bsn", _LL),
        ("a_saved", _P), ("tw", _P),
        ("daq", _P), ("das", _P), ("daTq", _P), ("daTs", _P), ("hTq", _P), ("hTs", _P),
        ("da", _P), ("hw", _P),
        ("part", _P), ("row_slot", _P), ("tile_expert", _P), ("num_rows_used", _P),
        ("E", _I), ("H", _I), ("D", _I), ("top_k", _I), ("plan_bm", _I), ("group_m", _I),
        ("rows", _LL), ("num_sms", _I), ("stream", _P),
    ]


class WgradParams(ctypes.Structure):
    _fields_ = [
        ("tokens", _P), ("stride_tokens", _LL), ("rows", _P), ("num_rows", _LL),
        ("out0", _P), ("out1", _P), ("row_slot", _P), ("seg_start", _P), ("count", _P),
        ("expert_order", _P),
        ("E", _I), ("M", _I), ("N", _I), ("m_split", _I), ("top_k", _I), ("gather", _I),
        ("regions", _I), ("out_f32", _I), ("num_sms", _I), ("ticket", _P), ("stream", _P),
    ]


class Fp8WgradParams(ctypes.Structure):
    _fields_ = [
        ("at", _P), ("at_scale", _P), ("stride_as", _LL),
        ("bt", _P), ("bt_scale", _P), ("stride_bs", _LL),
        ("out", _P), ("seg_start", _P), ("count", _P), ("expert_order", _P),
        ("E", _I), ("M", _I), ("N", _I), ("rows", _LL), ("group_m", _I),
        ("num_sms", _I), ("ticket", _P), ("stream", _P),
    ]


ENTRY_POINTS = {
    "gemm1_swiglu": {"megamoe_gemm1_swiglu": Gemm1SwigluParams,
                     "megamoe_fp8_gemm1_swiglu": Fp8Gemm1SwigluParams},
    "gemm_rows": {"megamoe_gemm_rows": GemmRowsParams,
                  "megamoe_fp8_gemm_rows": Fp8GemmRowsParams},
    "dgrad2_swiglu": {"megamoe_dgrad2_swiglu": Dgrad2SwigluParams,
                      "megamoe_fp8_dgrad2_swiglu": Fp8Dgrad2SwigluParams,
                      "megamoe_fp8_dgrad2_swiglu_rows": Fp8Dgrad2SwigluParams},
    "wgrad": {"megamoe_wgrad": WgradParams, "megamoe_fp8_wgrad": Fp8WgradParams},
}
"""csrc/<family>.cu -> its entry points and the struct each takes a pointer to."""
