import sys

from batchspec.cli.main import main

sys.exit(main())
