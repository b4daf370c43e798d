"""``eventbus offload`` (`eventbus.tier.cli.offload`) and ``eventbus replay``
(`eventbus.tier.cli.replay`): registered on the root typer app by `register`.

Both read the same settings as the library (``EVENTBUS_*``, ``EVENTBUS_TIER_*``, ``REDIS_URL``,
the standard ``AWS_*`` variables for S3), with command-line options as overrides
(`eventbus.tier.cli.common`).
"""

from __future__ import annotations

import typer

from eventbus.tier.cli.offload import offload
from eventbus.tier.cli.replay import replay


def register(app: typer.Typer) -> None:
    """Add the ``offload`` and ``replay`` commands to `app` (the root ``eventbus`` app)."""
    app.command("offload")(offload)
    app.command("replay")(replay)


__all__ = ["register"]
