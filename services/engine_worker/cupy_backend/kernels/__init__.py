"""CUDA C kernels for the cupy backend, one `.cu` file per op, each with a small launcher.

The sources compile at run time with NVRTC through `cupy.RawModule` (library.py), for the GPU
that runs them; `compile_check.py` compiles every one ahead of time with nvcc for sm_90, which
CI does on machines without a GPU. Launchers take CuPy arrays and a DTypeSpec.
"""
