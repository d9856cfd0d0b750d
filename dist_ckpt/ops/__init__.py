"""The operations side: inventory, retention and pins, DONE records and ``finish``, launcher
reports, log lines, diff and release export.

May import every lower layer (``restart``, ``format``, ``storage``, ``protocol``, ``tiers``,
``save``, ``restore``); nothing below imports it except through ``manager``.
"""
