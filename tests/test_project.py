"""The project's promises about itself: the README's commands and CI agree."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from chatlane import __version__

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    return re.findall(r"```sh\n(.+?)\n```", readme)


def test_ci_runs_exactly_the_readme_test_commands() -> None:
    run_command, test_command, slow_command = readme_commands()[:3]
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci_lines
    assert "pytest" in test_command
    assert "chatlane" in run_command
    assert slow_command in ci_lines  # the slow tests the default run leaves out
    assert "-m slow" in slow_command


def test_every_docs_page_the_readme_links_exists() -> None:
    readme = (ROOT / "README.md").read_text()
    for page in re.findall(r"\]\((docs/[^)]+)\)", readme):
        assert (ROOT / page).is_file(), page


def test_changelog_has_an_unreleased_section() -> None:
    assert "## Unreleased" in (ROOT / "CHANGELOG.md").read_text()


def test_cli_version_and_help() -> None:
    run = [sys.executable, "-m", "chatlane.cli"]
    version = subprocess.run([*run, "--version"], capture_output=True, text=True, check=True)
    assert __version__ in version.stdout
    help_ = subprocess.run([*run, "--help"], capture_output=True, text=True, check=True)
    assert "key" in help_.stdout


def pinned(requirement: str) -> tuple[str, str]:
    """``name[extras]==version`` as ``(name, version)``; any other form fails the test."""
    match = re.fullmatch(r"([\w-]+)(?:\[[\w,]+\])?==([\w.]+)", requirement)
    assert match is not None, f"{requirement!r} is not pinned with =="
    return match[1], match[2]


def test_the_benchmarks_peers_are_pinned_and_installed_at_their_pins() -> None:
    """A verdict against a peer holds for one version of it, so the bench extra names one."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pins = dict(map(pinned, project["project"]["optional-dependencies"]["bench"]))
    assert {"aiogram", "redis"} <= set(pins)
    assert {name: metadata.version(name) for name in pins} == pins
