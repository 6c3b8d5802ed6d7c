"""Build glue that pyproject.toml cannot express: the cffi extension of native/."""
from setuptools import setup

setup(cffi_modules=["native/build_ffi.py:ffibuilder"])
