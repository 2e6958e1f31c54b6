"""``python -m chatlane``: the same command line as the ``chatlane`` script."""

from chatlane.console import main

main()
