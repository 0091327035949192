"""Builds the optional C extension indexer._native (see indexer/native.py); all else is in
pyproject.toml. ``optional=True``: without a C compiler the install succeeds and the pure-Python
code is used."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "indexer._native",
            ["indexer/_native.c", "indexer/_ingest.c"],
            depends=["indexer/_ingest.h"],
            include_dirs=["third_party/xxhash"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
        Extension(
            "indexer._match",
            ["indexer/_match.c"],
            include_dirs=["third_party/xxhash"],
            optional=True,
            extra_compile_args=["-O2"],
        ),
    ]
)
