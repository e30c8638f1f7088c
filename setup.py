# The C engine is a cffi extension; setuptools needs `cffi_modules` here, everything else is in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["build_engine.py:ffibuilder"])
