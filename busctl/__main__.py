"""``python -m busctl``: the same as the ``busctl`` command (:func:`busctl.cli.main`)."""

from busctl.cli import main

raise SystemExit(main())
