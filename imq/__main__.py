"""``python -m imq``: the imq command."""

import sys

try:
    from imq.cli.main import command
except KeyboardInterrupt:  # Ctrl-C while the command's modules load: one line, as main() says
    print("imq: interrupted while starting; nothing was done", file=sys.stderr)
    raise SystemExit(130) from None

raise SystemExit(command())
