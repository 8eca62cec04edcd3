"""The package's PEP 517 build backend: setuptools', run on a copy of the source tree.

setuptools builds in the folder it is given, so `pip install .` would leave `build/` and
`agent_bus.egg-info/` in the checkout. Each hook here copies the tree (without VCS, venvs,
caches and earlier build output: a few MB) to a temporary folder, runs setuptools there, and
hands back only what pip asked for (a wheel, an sdist, metadata). Editable installs must point
at the checkout itself, so they run in place, and the `*.egg-info` setuptools writes there on
the way is removed afterwards: the installed metadata is the `.dist-info` in site-packages, and
nothing at run time reads the egg-info (left in the checkout, it was a second, stale copy).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from setuptools import build_meta as _setuptools

# Dot folders (.git, .venv, caches), build output, bytecode: a build reads none of them.
_SKIP = shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__")

Settings = dict[str, Any] | None


@contextmanager
def _in_a_copy() -> Iterator[None]:
    source = Path.cwd()
    with tempfile.TemporaryDirectory(prefix="agent-bus-build-") as tmp:
        copy = Path(tmp) / source.name
        shutil.copytree(source, copy, ignore=_SKIP, symlinks=True)
        os.chdir(copy)
        try:
            yield
        finally:
            os.chdir(source)


def get_requires_for_build_wheel(config_settings: Settings = None) -> list[str]:
    with _in_a_copy():
        return _setuptools.get_requires_for_build_wheel(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory: str,
                                     config_settings: Settings = None) -> str:
    target = os.path.abspath(metadata_directory)
    with _in_a_copy():
        return _setuptools.prepare_metadata_for_build_wheel(target, config_settings)


def build_wheel(wheel_directory: str, config_settings: Settings = None,
                metadata_directory: str | None = None) -> str:
    target = os.path.abspath(wheel_directory)
    metadata = os.path.abspath(metadata_directory) if metadata_directory else None
    with _in_a_copy():
        return _setuptools.build_wheel(target, config_settings, metadata)


def get_requires_for_build_sdist(config_settings: Settings = None) -> list[str]:
    with _in_a_copy():
        return _setuptools.get_requires_for_build_sdist(config_settings)


def build_sdist(sdist_directory: str, config_settings: Settings = None) -> str:
    target = os.path.abspath(sdist_directory)
    with _in_a_copy():
        return _setuptools.build_sdist(target, config_settings)


# `pip install -e .`: in place, as setuptools does it, then its egg-info is removed.
get_requires_for_build_editable = _setuptools.get_requires_for_build_editable


@contextmanager
def _no_egg_info_left() -> Iterator[None]:
    try:
        yield
    finally:
        for leftover in Path.cwd().glob("*.egg-info"):
            shutil.rmtree(leftover, ignore_errors=True)


def prepare_metadata_for_build_editable(metadata_directory: str,
                                        config_settings: Settings = None) -> str:
    with _no_egg_info_left():
        return _setuptools.prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_editable(wheel_directory: str, config_settings: Settings = None,
                   metadata_directory: str | None = None) -> str:
    with _no_egg_info_left():
        return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
