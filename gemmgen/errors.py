"""gemmgen's exceptions: every user-facing failure is one of these, raised before compile or launch."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class GemmgenError(Exception):
    """Base class of every error gemmgen raises on purpose."""


class RecipeError(GemmgenError, ValueError):
    """A recipe (GEMM declaration or epilogue) is invalid."""


class UnknownOpError(RecipeError, AttributeError):
    """An epilogue names an op gemmgen does not have (also an AttributeError, as Python expects)."""


class ConfigError(GemmgenError, ValueError):
    """A kernel configuration violates a hardware or CUTLASS constraint."""


class CompileError(GemmgenError, RuntimeError):
    """NVRTC rejected generated source; the message carries the log and the source path."""


class ToolchainError(GemmgenError, RuntimeError):
    """A required toolchain piece (headers, NVRTC, cuobjdump) could not be found."""


class InvalidArgument(GemmgenError, ValueError):
    """A runtime argument (tensor, scalar, shape) does not fit the compiled kernel."""


class LayoutMismatch(InvalidArgument):
    """A tensor's values fit but its memory layout does not (address or stride alignment, order):
    a copy would fix it. `argument` names it. Kernels raise it; torch ops copy the tensor instead."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(message)
        self.argument = argument


class NotDeterministic(GemmgenError, RuntimeError):
    """A kernel whose output can change from run to run (`KernelConfig(deterministic=False)`) was
    called while torch.use_deterministic_algorithms(True) is set, as torch's own such ops raise."""


class KernelNotAvailable(GemmgenError, RuntimeError):
    """A kernel is in no bundle and not in the cache, and compiling is disabled (GEMMGEN_JIT=0)."""


class GemmgenWarning(UserWarning):
    """Something gemmgen worked around and an operator should know of: a damaged cache or bundle
    entry not served, a read-only cache written elsewhere, a kernel kept only in memory."""


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """A " (did you mean 'x'?)" suffix naming the choice closest to a mistyped `name`, else "": what
    a typo needs is the right name, not a list to read."""
    options = list(choices)
    close = difflib.get_close_matches(name, options, n=1) or [c for c in options if c.lower() == name.lower()]
    return f" (did you mean {close[0]!r}?)" if close else ""


class ReadOnlyOption(InvalidArgument, AttributeError):
    """A layer's option (one its constructor takes, such as `activation`) was assigned after
    construction, where the layer's kernels and parameters were made for the old value: construct a
    new layer instead. Also an AttributeError, as Python's read-only attributes raise."""
