"""Running a recipe: the command line (``runner``), loading and checking a recipe before launch (``loader``), the
run folder, its console log, stop requests, checkpoints, plot and export, and the dry-run planner."""
