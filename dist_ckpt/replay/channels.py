"""The replay channels and what each one names: its record file, the record's key for its
destination, and the setting of its deadline.

A channel scopes a replay's store keys (``protocol/messages.py``), its fault points
(``<channel>.upload``, ...), its thread and its log lines. Two exist:

- ``persist``: the memory tier into the root (``memory/runner.py``), settings
  ``persist_queue`` and ``persist_timeout_s``;
- ``mirror``: the root into ``config.mirror`` (``lifecycle/replication.py``), settings
  ``mirror_queue`` and ``mirror_timeout_s``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Channel:
    record: str  # the record file under the source's root (``replay/record.py``)
    destination: str  # the record's key for the destination's URL
    timeout: str  # the CheckpointConfig field of the channel's deadline


CHANNELS = {
    "persist": Channel(record="persist.json", destination="root", timeout="persist_timeout_s"),
    "mirror": Channel(record="mirror.json", destination="mirror", timeout="mirror_timeout_s"),
}


def channel(name: str) -> Channel:
    try:
        return CHANNELS[name]
    except KeyError:
        raise ValueError(f"no replay channel {name!r} (one of {', '.join(CHANNELS)})") from None
