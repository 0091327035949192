"""Builds the optional C extension indexer._native (see indexer/native.py); all else is in
pyproject.toml. Optional: without a C compiler the install succeeds and the pure-Python code is
used. With ``KVROUTER_REQUIRE_NATIVE=1`` (as the tests run) a failed build fails the install
instead, so a rebuild in place never leaves the previous extension to be imported unnoticed."""

import os

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "indexer._native",
            [
                "indexer/_native.c",
                "indexer/_ingest.c",
                "indexer/_residency.c",
                "indexer/_removal.c",
                "indexer/_match.c",
                "indexer/_scan.c",
                "indexer/_u64map.c",
                "indexer/_u64map_type.c",
            ],
            depends=[
                "indexer/_buffers.h",
                "indexer/_ingest.h",
                "indexer/_masks.h",
                "indexer/_scan.h",
                "indexer/_u64map.h",
                "indexer/_u64map_impl.h",
            ],
            include_dirs=["third_party/xxhash"],
            optional=os.environ.get("KVROUTER_REQUIRE_NATIVE") != "1",
            extra_compile_args=["-O2"],
        ),
    ]
)
