"""One screen per view of the daemon (chat, learning, training, adapters) and the modals."""
