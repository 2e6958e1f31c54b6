"""``python -m chatlane``: the same command line as the ``chatlane`` script."""

from chatlane.cli import main

main(prog_name="chatlane")
