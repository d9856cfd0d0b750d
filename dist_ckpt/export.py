"""``dist_ckpt.export``: the name documented before the layout for :mod:`dist_ckpt.ops.export`.

The module replaces itself with that one, so both names are one module object.
"""

import sys

from .ops import export as _export

sys.modules[__name__] = _export
