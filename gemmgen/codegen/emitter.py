"""What each architecture's code generator provides: one `Emitter` per `Arch`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..config import Arch, KernelConfig
from ..ir import RecipeIR
from .evt import EpilogueCode
from .fields import ParamField
from .rules import Rule

#: SASS markers a kernel must show, as alternatives: (("HGMMA", "QGMMA"), ("UTMALDG",)) needs one
#: of the first two and the third. A marker is a mnemonic, optionally with modifiers that its
#: instructions must carry ("UTCHMMA.2CTA").
SassRequirement = tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Emitter:
    arch: Arch
    rules: Sequence[Rule]  # the constraints on a config (`rules.violations` applies them)
    type_context: Callable[..., dict]  # (kernel recipe, config, epilogue, collectives) -> the types template's context
    param_fields: Callable[[RecipeIR, KernelConfig, EpilogueCode], tuple[ParamField, ...]]
    sass_markers: tuple[str, ...]  # what a report counts
    required_sass: Callable[[KernelConfig, RecipeIR], SassRequirement]  # what proves this arch's path
    headers: Callable[[RecipeIR], tuple[str, ...]] = lambda recipe: ()  # what a kernel includes besides every kernel's
