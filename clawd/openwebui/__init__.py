"""Open WebUI, the chat UI many local-model users run, as a source of explicit feedback.

origin.py   what an Open WebUI request says about itself: its chat and message ids (headers),
            and whether it is one of Open WebUI's background tasks (title, tags, ...), a side turn
ratings.py  Open WebUI's feedback record (API, export file, POST /clawd/feedback) -> a Rating
matcher.py  a Rating -> the one clawd turn it rates (by message id; by text only when unambiguous)
ingest.py   apply a Rating: the turn's feedback rows replaced (a change) or deleted (a removal)
connector.py  the daemon's scheduled pull from Open WebUI's own API (openwebui.* settings)
"""
