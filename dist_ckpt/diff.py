"""``dist_ckpt.diff``: the name documented before the layout for :mod:`dist_ckpt.ops.diff`.

The module replaces itself with that one, so both names are one module object.
"""

import sys

from .ops import diff as _diff

sys.modules[__name__] = _diff
