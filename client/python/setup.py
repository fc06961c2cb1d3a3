"""Builds fsdp8-client: the SDK in fsdp8/ plus fsdp8/v1/*_pb2*.py generated from the repository's
proto/ with grpcio-tools at build time (nothing generated is committed).

FSDP8_PROTO_DIR overrides where the .proto files are read from (default: ../../proto)."""
import os
import pathlib

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = pathlib.Path(__file__).resolve().parent


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        from grpc_tools import protoc  # imported here: only needed when building

        proto_dir = pathlib.Path(os.environ.get("FSDP8_PROTO_DIR", HERE.parent.parent / "proto"))
        protos = sorted(str(p) for p in (proto_dir / "fsdp8" / "v1").glob("*.proto"))
        if not protos:
            raise SystemExit(f"fsdp8-client: no .proto files under {proto_dir}/fsdp8/v1")
        out = pathlib.Path(self.build_lib)
        (out / "fsdp8" / "v1").mkdir(parents=True, exist_ok=True)
        include = pathlib.Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
        args = ["grpc_tools.protoc", f"-I{proto_dir}", f"-I{include}", f"--python_out={out}",
                f"--pyi_out={out}", f"--grpc_python_out={out}", *protos]
        if protoc.main(args) != 0:
            raise SystemExit("fsdp8-client: protoc failed on " + " ".join(protos))
        (out / "fsdp8" / "v1" / "__init__.py").write_text(v1_init([pathlib.Path(p).stem for p in protos]))


def v1_init(stems):
    """fsdp8/v1/__init__.py: the message modules (*_pb2, protobuf only) imported with the package,
    so that `fsdp8.v1.jobs_pb2` works after `import fsdp8.v1`; the gRPC stub modules (*_pb2_grpc)
    on first use (they import grpc)."""
    messages = ", ".join(f"{s}_pb2" for s in stems)
    stubs = ", ".join(f'"{s}_pb2_grpc"' for s in stems)
    return (f'"""Generated from proto/fsdp8/v1 by client/python/setup.py."""\n'
            f"import importlib\n\n"
            f"from fsdp8.v1 import {messages}  # noqa: F401\n\n"
            f"_STUBS = ({stubs},)\n\n\n"
            f"def __getattr__(name):\n"
            f"    if name in _STUBS:\n"
            f"        return importlib.import_module(__name__ + '.' + name)\n"
            f"    raise AttributeError(f'module {{__name__!r}} has no attribute {{name!r}}')\n")


setup(cmdclass={"build_py": BuildWithStubs})
