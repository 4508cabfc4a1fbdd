import sys

from sweep.report.cli import main

sys.exit(main())
