"""``python -m kvpressure``: the ``kvpressure`` command (:func:`kvpressure.agent.cli.main`)."""

import sys

from kvpressure.agent.cli import main

sys.exit(main())
