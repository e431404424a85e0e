"""``python -m treegen`` is the ``treegen`` command line."""

from treegen.cli import run_cli

run_cli()
