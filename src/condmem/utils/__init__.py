"""Small shared helpers: atomic file writes, logging set-up, host-to-device copies that do not wait."""
