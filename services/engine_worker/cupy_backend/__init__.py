"""The cupy backend (`--backend cupy`): our CUDA C kernels through CuPy, cuBLAS GEMMs, decode
steps replayed from CUDA graphs."""
