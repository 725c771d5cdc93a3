"""Transfer from sibling devices: their records and best schedules, loaded for the device being tuned."""
