"""The `fedweave` command line.

fedweave --version
fedweave --help
"""

from __future__ import annotations

import typer

from org_node import __version__

app = typer.Typer(
    name="fedweave",
    help=(
        "fedweave: federated training across organizations with no central server.\n\n"
        "Each institution runs one org node. Nodes find each other over a signed gossip "
        "overlay, add their updates by peer-to-peer secure aggregation, and rebuild a "
        "wiped org from erasure-coded shards held by its peers."
    ),
    no_args_is_help=True,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"fedweave {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False,
        "--version",
        help="Print the version and exit.",
        callback=_print_version,
        is_eager=True,
    ),
) -> None:
    """fedweave: federated training with no central server."""


@app.command("info")
def info() -> None:
    """Show the installed layers and their versions."""
    import numpy

    import secure_agg

    typer.echo(f"fedweave {__version__}")
    typer.echo(f"numpy {numpy.__version__}")
    typer.echo(f"secure_agg exports: {', '.join(secure_agg.__all__) or '(none yet)'}")


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
