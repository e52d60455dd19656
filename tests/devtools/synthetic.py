"""A small synthetic package for planting violations of the source rules in."""

from pathlib import Path


def write_package(tmp_path: Path, files: dict[str, str]) -> Path:
    """A package ``nereus`` under ``tmp_path`` with the given files (relative path -> source)."""
    root = tmp_path / "nereus"
    for rel, text in {"__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root
