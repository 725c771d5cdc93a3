"""Record stores: every measurement a device's tuning committed (MetaSchedule's Database seam)."""
