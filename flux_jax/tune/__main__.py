"""`python -m flux_jax.tune`: see flux_jax/tune/__init__.py and docs/tuning.md."""

import sys

from flux_jax.tune import main

sys.exit(main())
