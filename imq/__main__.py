"""``python -m imq``: the imq command."""

from imq.cli.main import main

raise SystemExit(main())
