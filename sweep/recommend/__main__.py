from sweep.recommend import STOPPED
from sweep.startup import exit_interruptible, startup_sigint

startup_sigint(True, STOPPED)  # first: the imports below take seconds

from sweep.recommend.cli import main  # noqa: E402

exit_interruptible(main, STOPPED)
