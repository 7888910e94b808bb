"""The model store on disk: ``models/<name>/<version>/`` folders and what they hold now."""

from __future__ import annotations

from pathlib import Path

__all__ = ["FolderSnapshot", "discover_models", "folder_snapshot", "version_key"]


def version_key(version: str) -> tuple[int, int | str]:
    """Numeric versions (ASCII digits only) sort numerically and after any non-numeric ones."""
    # str.isdigit() also holds for '²' and '①', which int() refuses: one folder so named
    # would stop every model from loading.
    numeric = version.isascii() and version.isdigit()
    return (1, int(version)) if numeric else (0, version)


def discover_models(models_dir: Path) -> dict[str, list[Path]]:
    """Model name -> version folders (sorted, lowest first) that hold a manifest."""
    found: dict[str, list[Path]] = {}
    if not models_dir.is_dir():
        return found
    for manifest in sorted(models_dir.glob("*/*/manifest.json")):
        version_dir = manifest.parent
        found.setdefault(version_dir.parent.name, []).append(version_dir)
    for versions in found.values():
        versions.sort(key=lambda p: version_key(p.name))
    return found


FolderSnapshot = tuple[tuple[str, int, int], ...]
"""Every file under a folder as (relative path, size in bytes, mtime in ns), sorted."""


def folder_snapshot(folder: Path) -> FolderSnapshot:
    """What a version folder holds now; a file replaced in place changes its size or mtime."""
    entries = []
    for path in sorted(folder.rglob("*")):
        try:
            if path.is_file():
                stat = path.stat()
                entries.append((str(path.relative_to(folder)), stat.st_size, stat.st_mtime_ns))
        except FileNotFoundError:  # removed while the folder was walked
            continue
    return tuple(entries)
