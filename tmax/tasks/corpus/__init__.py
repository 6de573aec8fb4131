"""`tmax data`: synthesis, import, validation and analysis of Harbor task corpora."""
