"""IR + KernelConfig -> CUTLASS 3.x C++ source, per architecture. Templates bind types and constants only.

`evt` lowers the epilogue IR to CUTLASS's visitor tree (shared by every architecture: sm100 reuses
the sm90 visitors), `direct` to the per-element functor of gemmgen's own epilogue collective
(`EpilogueCollective.DIRECT`, sm90); each architecture's package (`sm90`, `sm100`) holds what its kernels
instantiate, the Params fields the host writes, the SASS that proves its path and its constraints
on configs (its `Emitter`), which `validate` and `is_valid` apply before anything is rendered or
compiled. The config's `arch` picks the emitter.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path

import jinja2

from .._version import __version__
from ..config import Arch, EpilogueCollective, KernelConfig, default_config, kernel_id, kernel_recipe
from ..errors import ConfigError, ToolchainError
from ..ir import RecipeIR
from . import rules, sm90, sm100
from .direct import build_direct_epilogue
from .emitter import Emitter, SassRequirement
from .evt import EpilogueCode, build_epilogue
from .fields import ParamField, ParamsLayout

__all__ = ["EMITTERS", "INFO_FIELDS", "Emitter", "EpilogueCode", "GeneratedKernel", "ParamField", "ParamsLayout",
           "SassRequirement", "emitter", "fitting_default", "is_valid", "kernel_id", "render_kernel",
           "template_environment", "templates_dir", "validate", "violations"]

#: The code generator of each architecture.
EMITTERS: dict[Arch, Emitter] = {Arch.SM90A: sm90.EMITTER, Arch.SM100A: sm100.EMITTER}


def emitter(arch: Arch) -> Emitter:
    return EMITTERS[arch]


def violations(cfg: KernelConfig, recipe: RecipeIR) -> list[str]:
    """Every constraint of its architecture that `cfg` breaks for the recipe as declared."""
    return rules.violations(emitter(cfg.arch).rules, cfg, recipe)


def is_valid(cfg: KernelConfig, recipe: RecipeIR) -> bool:
    return not violations(cfg, recipe)


def fitting_default(recipe: RecipeIR, arch: Arch) -> KernelConfig:
    """gemmgen's default config for the recipe on `arch` (`config.default_config`), or where its
    epilogue's shared memory leaves the main loop one stage, the same with tile N, then K, halved
    (then tile N quartered: an sm_100a K-grouped fp8 kernel's): the first of those its
    architecture takes (none: the default, whose violations then say why)."""
    default = default_config(recipe, arch)
    tm, tn, tk = default.tile
    for tile in ((tm, tn, tk), (tm, tn // 2, tk), (tm, tn, tk // 2), (tm, tn // 2, tk // 2), (tm, tn // 4, tk)):
        if is_valid(config := replace(default, tile=tile), recipe):
            return config
    return default


def validate(cfg: KernelConfig, recipe: RecipeIR) -> None:
    """Raise one ConfigError naming every broken constraint (before anything is compiled)."""
    if not isinstance(cfg, KernelConfig):
        raise ConfigError(f"config: expected a gemmgen.KernelConfig, got {cfg!r}")
    rules.raise_violations(violations(cfg, recipe), cfg, recipe)

#: Fields of the `<entry>_info` array every kernel exports (see templates/kernel.cu.j2).
INFO_FIELDS: tuple[tuple[str, str], ...] = (
    ("params_size", "sizeof(Params)"),
    ("params_align", "alignof(Params)"),
    ("smem_bytes", "GemmKernel::SharedStorageSize"),
    ("max_threads", "GemmKernel::MaxThreadsPerBlock"),
    ("min_blocks", "GemmKernel::MinBlocksPerMultiprocessor"),
    ("cluster_size", "cute::size(ClusterShape{})"),
)


@functools.cache
def templates_dir() -> Path:
    """The jinja2 kernel templates: kernel.cu.j2 (the entry points, shared), sm90/ and sm100/ (the
    types each arch's kernel instantiates). They live in the repository's top-level templates/; a
    wheel ships them inside the package (pyproject.toml's force-include), so the same lookup serves
    a checkout, an editable install and an installed wheel."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "templates", package.parent / "templates"):
        if (candidate / "kernel.cu.j2").is_file():
            return candidate
    raise ToolchainError(f"gemmgen's kernel templates are missing: neither {package / 'templates'} (an "
                         f"installed wheel) nor {package.parent / 'templates'} (a checkout) holds kernel.cu.j2; "
                         "reinstall gemmgen")


@functools.cache
def template_environment() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir())), undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)


@dataclass(frozen=True)
class GeneratedKernel:
    recipe: RecipeIR  # as declared
    config: KernelConfig
    kernel_recipe: RecipeIR  # what the kernel computes: `recipe`, transposed under config.swap_ab
    entry: str  # the extern "C" kernel symbol
    source: str
    epilogue: EpilogueCode
    fields: tuple[ParamField, ...]  # the Params fields the host writes (codegen.fields)
    required_sass: SassRequirement  # what its SASS must show (`Emitter.required_sass`)

    @property
    def arch(self) -> Arch:
        return self.config.arch

    @property
    def info_symbol(self) -> str:
        return f"{self.entry}_info"

    def __repr__(self) -> str:  # not the ~100 KB source
        return f"GeneratedKernel({self.recipe.name!r}, {self.config.name}, entry={self.entry}, " \
               f"{len(self.source)} characters of source)"


def render_kernel(recipe: RecipeIR, config: KernelConfig, collectives: str = "resolved") -> GeneratedKernel:
    """The kernel's source for `config`; configs that differ only in launch arguments (`splits`,
    `deterministic`) render the same source, so they share one binary. The GeneratedKernel keeps
    `config` whole."""
    validate(config, recipe)
    code = config.binary()
    view = kernel_recipe(code, recipe)
    emit = emitter(config.arch)
    epi = build_epilogue(view, config.arch)
    direct = config.epilogue is EpilogueCollective.DIRECT
    if direct:  # gemmgen's own collective over a generated functor, not the visitor tree (`direct`)
        epi = replace(epi, direct=build_direct_epilogue(view), layout="direct")
    fields = emit.param_fields(view, code, epi)
    entry = f"gemmgen_{recipe.name}_{code.name}_{kernel_id(recipe, code)}"  # readable in a profiler
    source = template_environment().get_template("kernel.cu.j2").render(
        version=__version__, recipe_name=recipe.name, recipe_key=recipe.key, config_name=code.name, entry=entry,
        epilogue_summary="direct: a generated functor, from registers to global memory" if direct else
        f"{epi.layout} of {len(epi.decls)} visitor types", info_fields=INFO_FIELDS,
        # a grouped kernel's module also holds the kernel that fills its per-group arrays
        extra_headers=[*emit.headers(recipe), *(["gemmgen/grouped.hpp"] if recipe.gemm.grouped else []),
                       *(["gemmgen/direct_epilogue.hpp"] if direct else [])],
        setup_entries=[f"{entry}_groups"] if recipe.gemm.grouped else [],
        param_fields=tuple((f.name, f.lvalue("p"), f.lvalue("d")) for f in fields),
        **emit.type_context(view, code, epi, collectives))
    return GeneratedKernel(recipe, config, view, entry, source, epi, fields, emit.required_sass(code, view))
