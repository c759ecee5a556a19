"""clawd's Textual TUI (a pure HTTP client of the daemon); see issue 5."""
