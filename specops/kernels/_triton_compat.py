"""Compatibility shim for Triton's CPU interpreter (TRITON_INTERPRET=1); no effect on compiled kernels.

In the interpreter every scalar (``tl.program_id``, an int argument, a scalar ``tl.load``, a
reduction to a scalar) is a 1-element NumPy array of shape (1,), never 0-d, and a Python
``range(start, end, step)`` in a kernel turns tensor bounds into ints via ``tensor.__index__``.
Triton <= 3.6 implements that as ``int(self.handle.data)``, which NumPy >= 2.4 rejects for
ndim > 0 arrays ("only 0-dimensional arrays can be converted to Python scalars"), so every
loop with a runtime bound fails. Triton fixed it upstream (triton-lang/triton#9171, PR #9172:
``int(self.handle.data.squeeze())``, as in Triton 3.9); this applies the same one-line fix to
older interpreters. No kernel-side rewrite avoids it short of changing the loops' GPU code.
"""

from __future__ import annotations

import os


def patch_interpreter_index() -> None:
    """Make interpreted tensors' ``__index__`` accept shape-(1,) scalars (idempotent)."""
    if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"):
        return  # compiled kernels never go through the interpreter
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - no Triton: the reference paths are used
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_specops_index_fix", False):
        return

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        # Recorded in the same scope, so it is undone (LIFO) with Triton's own patches after the launch.
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    _patch_lang_tensor._specops_index_fix = True
    interpreter._patch_lang_tensor = _patch_lang_tensor
