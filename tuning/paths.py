"""Where the tuner keeps its state: one user cache directory, overridable for tests, CI
and shared setups."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """MOEFORGE_CACHE_DIR, else $XDG_CACHE_HOME/moeforge, else ~/.cache/moeforge."""
    env = os.environ.get("MOEFORGE_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moeforge"


def profile_dir(override: str | os.PathLike | None = None) -> Path:
    """--profile-dir, else MOEFORGE_PROFILE_DIR, else <cache>/profiles."""
    if override:
        return Path(override)
    env = os.environ.get("MOEFORGE_PROFILE_DIR")
    return Path(env) if env else cache_dir() / "profiles"


def default_storage_url() -> str:
    """The embedded study database: running the same command again resumes from it."""
    return f"sqlite:///{cache_dir() / 'tuning.db'}"


def shipped_profiles() -> list[Path]:
    """Profiles that ship inside the package (tuned on the team's cards)."""
    from importlib import resources
    root = resources.files("moeforge").joinpath("profiles")
    try:
        return sorted(Path(str(p)) for p in root.iterdir() if p.name.endswith(".yaml"))
    except (FileNotFoundError, NotADirectoryError):
        return []
