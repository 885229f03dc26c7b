"""Layer norm on the CPU kernels (csrc/layer_norm.cc): each row normalised alone, in one fixed order, so a row's
numbers are the same in a step of one row and in a step of many (XLA's reductions are vectorised by the whole
array's shape). A speculative check's rows then equal the decode steps' they stand for, int8 weights included."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from opt_serving.backend.cpu import _lib


def layer_norm(x, scale, bias, eps: float):
    """x [..., D] float32 -> (x - mean) / sqrt(var + eps) * scale + bias over the last axis (scale, bias [D])."""
    _lib.lib()  # its FFI targets registered
    x2 = x.reshape(-1, x.shape[-1])  # [rows, D]
    y = jax.ffi.ffi_call(_lib.LAYER_NORM, jax.ShapeDtypeStruct(x2.shape, jnp.float32))(
        x2.astype(jnp.float32), scale.astype(jnp.float32), bias.astype(jnp.float32), eps=np.float32(eps))
    return y.reshape(x.shape)
