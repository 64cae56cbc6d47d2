"""Test infrastructure shipped with gemmgen: CPU stand-ins for what needs a GPU or a host compiler.

- `oracle`: CUTLASS's own host code, built by nvcc, as the reference for argument building;
- `recording`: a recording `cuTensorMapEncodeTiled` with the driver's documented rules;
- `stub_driver`: a stand-in libcuda.so.1, so the driver layer runs end to end through cuda.bindings;
- `emulate`: what a kernel computes from a Params block, evaluated in fp32;
- `visitors`: the epilogue a kernel's C++ source declares, run as CUTLASS's sm90 visitors would
  (what `emulate` evaluates), its C++ types parsed by `cpp_types`;
- `random_recipes`: random recipes, for checks of everything gemmgen generates;
- `tensors`, `timing`: strided test tensors, host-time medians.
"""
