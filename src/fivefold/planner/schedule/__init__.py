"""Pipeline schedules as per-rank action lists, and their event simulation against stage costs."""
