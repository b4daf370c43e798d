"""Talking to Redis: the client with its deadlines (`connection`), URL checks and redaction
(`addresses`), retrying (`retry`) and the event loop of eventbus's own runs (`loops`)."""
