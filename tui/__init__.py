"""clawd's Textual TUI (`clawd chat`): a pure HTTP client of the daemon; see tui/app.py."""
