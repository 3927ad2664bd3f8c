"""``python -m glm5.cli ...``: the `glm5` command."""

import sys

from glm5.cli import main

sys.exit(main())
