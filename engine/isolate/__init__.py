"""Child processes for work that may run away: bounded in time and memory, stopped on cancel."""
