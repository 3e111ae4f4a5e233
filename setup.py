"""Build the optional C accelerator of the iterator; everything else is in pyproject.toml.

``optional=True``: without a C compiler the build goes on, and imq uses its pure-Python
decode (same results, slower iteration; benchmarks/README.md has both figures).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("imq._speedups", ["imq/_speedups.c"], optional=True),
    ]
)
