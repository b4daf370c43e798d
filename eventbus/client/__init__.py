"""Talking to Redis: the client with its deadlines (`connection`), retrying (`retry`), pipelines
that keep the server's reasons (`pipelines`) and the event loop of eventbus's own runs (`loops`).
URL checks and redaction are configuration: `eventbus.config.addresses`."""
