"""The `fedweave` entry point answers --version and --help."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from api.cli import app
from org_node import __version__

runner = CliRunner()


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"fedweave {__version__}"
    assert __version__ != "0.0.0+unknown"


def test_help_lists_the_product() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "no central server" in result.stdout


def test_console_script_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "api.cli", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.startswith("fedweave ")


def test_every_command_is_on_the_console_script() -> None:
    names = {c.name for c in app.registered_commands} | {g.name for g in app.registered_groups}
    assert {"init", "run", "status", "recover", "federation", "audit"} <= names


def test_unknown_command_is_a_clean_error() -> None:
    result = runner.invoke(app, ["no-such-command"])
    assert result.exit_code == 2
