"""``python -m rollcall.cli``: the ``rollcall`` command."""

from rollcall.cli import main

main()
