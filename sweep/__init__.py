"""clipamp sweep app."""
