"""Regenerate the Python code for protos/kvmesh/v1 into shared/pb (`make protos`).

grpcio-tools writes imports as `from kvmesh.v1 import x_pb2`, which would collide with our own
`kvmesh` package, so each generated import is rewritten to `shared.pb.kvmesh.v1`. The output
is byte-for-byte reproducible; tests/test_protos.py fails when the committed code is stale.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import sys
import tempfile

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
DEFAULT_OUT = ROOT / "shared" / "pb"
_IMPORT = re.compile(r"^from kvmesh\.v1 import ", re.MULTILINE)


def proto_files() -> list[pathlib.Path]:
    return sorted((PROTO_ROOT / "kvmesh" / "v1").glob("*.proto"))


def generate(out_dir: pathlib.Path) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        well_known = pathlib.Path(protoc.__file__).parent / "_proto"
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={scratch}",
            f"--pyi_out={scratch}",
            f"--grpc_python_out={scratch}",
            *(str(p.relative_to(PROTO_ROOT)) for p in proto_files()),
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        target = out_dir / "kvmesh" / "v1"
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        for package in (out_dir, out_dir / "kvmesh", target):
            (package / "__init__.py").write_text("")
        for generated in sorted((pathlib.Path(scratch) / "kvmesh" / "v1").iterdir()):
            text = _IMPORT.sub("from shared.pb.kvmesh.v1 import ", generated.read_text())
            (target / generated.name).write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    generate(parser.parse_args().out)


if __name__ == "__main__":
    sys.exit(main())
