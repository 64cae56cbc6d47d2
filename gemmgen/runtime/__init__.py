"""Calling compiled kernels from torch: argument checks (`checks`), CUTLASS's Params and tensor maps
built in Python (`arguments`, `tma`, `scheduler`), the driver launch (`driver`), and the kernels:
`kernel.Kernel` runs a dense (or batched) recipe, `grouped.GroupedKernel` a grouped one, both
`base.KernelBase`s. Importing this package imports no torch; its kernel modules do."""
