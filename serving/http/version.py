"""The version the server reports (`/v2` metadata, the OpenAPI document).

Read from the installed distribution's metadata rather than from the root package `tessera`,
which serving may not import (see the import contracts in pyproject.toml).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def _installed_version() -> str:
    try:
        return version("tessera")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "0+unknown"


SERVER_VERSION: str = _installed_version()
