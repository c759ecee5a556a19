"""Model runtimes behind one contract (base.py); each module exports `Engine`."""
