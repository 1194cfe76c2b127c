"""The torch and Triton releases ScaleFold is tested with: the one place their range is written.

CI runs both ends (``.ci/run``): the main suite the newest (``TOP``: ``TORCH_SPEC``/``TRITON_SPEC``
in the Makefile), the floor job the oldest (``FLOOR``: ``.ci/floor-constraints.txt``), which
``pyproject.toml`` declares as its lower bounds (``tests/test_packaging.py`` keeps them equal).

``scalefold check-versions`` (:func:`main`) prints the installed torch, Triton and numpy and exits 1
when torch or Triton lies outside the tested range -- the Dockerfile runs it on its base image.
A pre-release of the floor's own minor version (NGC's ``2.6.0a0+ecf3bae``, a snapshot before
2.6.0) counts as below the floor; other pre-releases count as their minor version.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import sys

#: oldest tested (major, minor): torch 2.6.0 / Triton 3.2.0 (Triton 3.0/3.1, i.e. torch 2.4/2.5,
#: compute wrong kernel outputs in the CPU interpreter the kernel tests run in)
FLOOR = {"torch": (2, 6), "triton": (3, 2)}
#: newest tested (major, minor): CI's main suite, torch 2.13.0 / Triton 3.9.0
TOP = {"torch": (2, 13), "triton": (3, 9)}

_VERSION = re.compile(r"(\d+)\.(\d+)(?:\.\d+)*(?P<pre>(?:a|b|rc|\.?dev)\d*)?")


def parse(version: str) -> tuple[tuple[int, int], bool] | None:
    """``((major, minor), is_prerelease)`` of a version string (local suffixes ignored), None if unreadable."""
    match = _VERSION.match(version.strip())
    if not match:
        return None
    return (int(match.group(1)), int(match.group(2))), bool(match.group("pre"))


def outside_range(package: str, version: str | None) -> str | None:
    """Why ``version`` of ``package`` (``torch``/``triton``) is outside the tested range, or None."""
    low, high = FLOOR[package], TOP[package]
    tested = f"tested: {package} {low[0]}.{low[1]} to {high[0]}.{high[1]}"
    if version is None:
        return f"{package} is not installed ({tested})"
    parsed = parse(version)
    if parsed is None:
        return f"{package} {version}: unreadable version ({tested})"
    minor, pre = parsed
    if minor < low or (minor == low and pre):
        return f"{package} {version} is older than the tested floor ({tested})"
    if minor > high:
        return f"{package} {version} is newer than the newest tested ({tested})"
    return None


def installed(package: str) -> str | None:
    """The importable module's ``__version__`` (NGC images ship Triton under other distribution names,
    e.g. ``pytorch-triton``), else the distribution's; None when neither exists."""
    try:
        return str(importlib.import_module(package).__version__)
    except Exception:  # noqa: BLE001 - absent or broken: try the distribution record
        pass
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> int:
    found = {name: installed(name) for name in ("torch", "triton", "numpy")}
    print(", ".join(f"{name} {version or '(not installed)'}" for name, version in found.items()))
    problems = [p for p in (outside_range(name, found[name]) for name in FLOOR) if p]
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0

