"""Looking at runs: ``meshrun report`` (HTML page and PNGs), ``meshrun runs`` (one row per run directory)."""
