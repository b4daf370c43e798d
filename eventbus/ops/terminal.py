"""Text on its way to a terminal or a log: every Redis password this process knows scrubbed,
control characters escaped (`terminal_safe`); the stderr `console` that the commands and the
log handlers share. `eventbus.cli.output` builds the commands' output on it; `eventbus.ops.logs`
filters every log record through it."""

from __future__ import annotations

import re

from rich.console import Console

from eventbus.config.addresses import scrub


def data_console(*, stderr: bool = False) -> Console:
    """A rich console for output holding user data: no emoji codes (``user:id:42`` would print
    as "user" + an emoji + "42") and no highlighting (colours guessed from the data's shape)."""
    return Console(stderr=stderr, emoji=False, highlight=False)


console = data_console(stderr=True)

# C0 and C1 controls (ESC, CR, BS, ...) except tab and newline, line separators, bidi overrides
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
# URLs seen by this process (settings, --redis-url): their secrets are scrubbed from output
_URLS: set[str] = set()


def remember_url(url: str) -> None:
    """Scrub the secrets of `url` (a Redis URL this process uses) from all output from now on."""
    _URLS.add(url)


def terminal_safe(text: object, *, newlines: bool = False) -> str:
    """`text` as it may reach a terminal: control characters (escape sequences, carriage
    returns, bidi overrides) shown as ``\\xNN`` escapes, newlines and tabs too unless
    `newlines`, and every known Redis password replaced by ``***``."""
    out = str(text)
    for url in _URLS:
        out = scrub(out, url)
    if not newlines:
        out = out.replace("\n", "\\n").replace("\t", "\\t")
    return _CONTROL_CHARS.sub(lambda m: f"\\x{ord(m.group()):02x}", out)
