"""Cost models: how a candidate is scored before it is measured (MetaSchedule's CostModel seam)."""
