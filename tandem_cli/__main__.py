import sys

from tandem_cli.cli import main

sys.exit(main())
