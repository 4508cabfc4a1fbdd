import sys

from sweep.report.tables import main

sys.exit(main())
