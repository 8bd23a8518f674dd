"""Regenerate src/diloco/wire/diloco_pb2*.py from diloco.proto (needs the dev extra: grpcio-tools)."""

import pathlib
import sys

from grpc_tools import protoc

src = pathlib.Path(__file__).resolve().parents[1] / "src"
code = protoc.main([
    "grpc_tools.protoc", f"-I{src}", f"--python_out={src}", f"--pyi_out={src}", f"--grpc_python_out={src}",
    str(src / "diloco/wire/diloco.proto"),
])
sys.exit(code)
