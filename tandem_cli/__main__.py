import sys

from tandem_cli.child_setup import adopt_launcher_settings

adopt_launcher_settings()  # before torch starts its threads: they inherit the cores

from tandem_cli.cli import main  # noqa: E402

sys.exit(main())
