"""The `fedweave` console script: the org node's commands plus ``fedweave run``.

Every command but ``run`` lives in :mod:`org_node.cli`; ``run`` starts the whole node
(admin API, peer API, gossip, run engine) through the composition root
:mod:`api.serve`, which is why the console script points here, at the top layer.

    fedweave run --data-dir DIR [--passphrase-file FILE]   (or FEDWEAVE_PASSPHRASE)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import typer

from org_node.cli import DataDir, app, guarded
from org_node.cli_common import PassphraseFileOpt

__all__ = ["app", "main", "run"]


@app.command("run")
def run(data_dir: Path = DataDir, passphrase_file: PassphraseFileOpt = None) -> None:
    """Run the node: admin API, mutual-TLS peer API, gossip and the run engine."""
    import asyncio
    import logging

    from api.serve import serve_node
    from org_node.passphrase import PASSPHRASE_ENV, read_passphrase

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    def ready(message: str) -> None:
        typer.echo(message)
        sys.stdout.flush()

    passphrase = guarded(lambda: read_passphrase(passphrase_file))
    os.environ.pop(PASSPHRASE_ENV, None)  # read once; no child process inherits it
    guarded(lambda: asyncio.run(serve_node(data_dir, on_ready=ready, passphrase=passphrase)))
    typer.echo("stopped")


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
