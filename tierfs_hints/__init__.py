"""Data-loading helpers for training on tierfs: access hints, sampling and collation.

``import tierfs_hints`` loads the standard library only (safe and cheap in DataLoader workers):
the hints API of :mod:`tierfs_hints.client` is re-exported here. :mod:`tierfs_hints.torch`
(samplers and shard lists that announce each epoch) and :mod:`tierfs_hints.collate` are
imported explicitly by code that has torch. See ``docs/hints.md``.
"""

from tierfs_hints.client import (
    Client,
    NeedHandle,
    Progress,
    TierfsHintWarning,
    checkpoint,
    default_client,
    epoch,
    need,
    phase,
    release,
    wait_durable,
)

__all__ = [
    "Client",
    "NeedHandle",
    "Progress",
    "TierfsHintWarning",
    "checkpoint",
    "default_client",
    "epoch",
    "need",
    "phase",
    "release",
    "wait_durable",
]
