"""One router per resource; all read-only."""
