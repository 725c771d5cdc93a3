"""A relax expression's constant value, read through the variable it may be bound to: the one check that the
numpy folds of the import and fusion (`onnx.py`) and the Winograd legalization (`winograd.py`) share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def bound_constant(expr: Any, lookup_binding: Callable[[Any], Any]) -> np.ndarray | None:
    """`expr`'s value as a numpy array where it is a tensor constant or a variable bound to one (through
    `lookup_binding`: a mutator's or block builder's); None otherwise."""
    import tvm

    if isinstance(expr, tvm.relax.Var):
        expr = lookup_binding(expr)
    if isinstance(expr, tvm.ir.GenericConst) and hasattr(expr.value, "numpy"):
        return expr.value.numpy()
    return None
