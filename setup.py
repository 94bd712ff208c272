"""Builds the one native module, transfer._native, from cpp/ (everything else is in pyproject.toml)."""
from glob import glob

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

native = Pybind11Extension(
    "transfer._native",
    sorted(glob("cpp/*.cpp")),
    cxx_std=17,
    extra_compile_args=["-O3", "-pthread", "-Wall", "-Wextra", "-Wno-missing-field-initializers"],
    extra_link_args=["-pthread"],
)

setup(ext_modules=[native], cmdclass={"build_ext": build_ext})
