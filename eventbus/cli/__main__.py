"""``python -m eventbus.cli``: the ``eventbus`` command (``run --processes N`` starts its children
this way)."""

from eventbus.cli import main

main()
