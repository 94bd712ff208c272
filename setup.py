"""Builds the native module (transfer._native, from cpp/) and generates the gRPC stubs (from
proto/) before packaging; everything else is in pyproject.toml."""
from glob import glob
from pathlib import Path

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

ROOT = Path(__file__).resolve().parent


def generate_grpc_stubs() -> None:
    """proto/kvstore/<service>/v1/*.proto -> kvstore/<service>/v1/*_pb2*.py (never committed)."""
    from grpc_tools import protoc

    include = Path(protoc.__file__).parent / "_proto"
    for proto in sorted((ROOT / "proto").rglob("*.proto")):
        args = ["protoc", f"-I{ROOT / 'proto'}", f"-I{include}", f"--python_out={ROOT}", f"--pyi_out={ROOT}",
                f"--grpc_python_out={ROOT}", str(proto)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")


generate_grpc_stubs()

native = Pybind11Extension(
    "transfer._native",
    sorted(glob("cpp/*.cpp")),
    cxx_std=17,
    extra_compile_args=["-O3", "-pthread", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
    extra_link_args=["-pthread"],
    libraries=["crypto"],  # AES-GCM of encrypted TCP streams (OpenSSL libcrypto)
)

setup(ext_modules=[native], cmdclass={"build_ext": build_ext})
