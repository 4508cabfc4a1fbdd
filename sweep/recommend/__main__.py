import sys

from sweep.recommend.cli import main

sys.exit(main())
