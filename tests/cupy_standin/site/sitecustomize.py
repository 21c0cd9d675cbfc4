"""On PYTHONPATH (KVMESH_CUPY_STANDIN=1 make gpu-check puts it there), every Python process
of a rehearsal, the mesh's services included, starts with the CPU stand-in for CuPy
installed: `import cupy` finds it."""

import os

if os.environ.get("KVMESH_CUPY_STANDIN") == "1":
    from tests.cupy_standin import installed

    _STANDIN = installed()  # referenced for the process's life: collected, it would undo itself
    _STANDIN.__enter__()
