"""``python -m worker``: the same commands as the ``kafka-triton-worker`` script."""

from worker.cli import main

raise SystemExit(main())
