"""Small shared helpers: atomic file writes, logging set-up."""
