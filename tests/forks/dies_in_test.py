"""The default task, except that rank 1 of a torchrun job's first attempt is killed (kill -9) as it starts
the run's fourth evaluation: with --epochs 3, the test pass, after the last save (tests/test_elastic.py)."""

import os
import signal

from forks import classification
from forks.classification import *  # noqa: F403 (the default task, whole)


class Tally(classification.Tally):
    made = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        Tally.made += 1
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if Tally.made == 4 and os.environ.get("RANK") == "1" and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)
