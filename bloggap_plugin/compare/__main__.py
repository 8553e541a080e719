"""``python -m bloggap_plugin.compare --worker SPEC``: the run subprocess the sweep starts (internal)."""

import sys

from bloggap_plugin.compare.worker import main

sys.exit(main())
