"""`publish()`: `publisher` -> encode and check (`encoding`) -> ordered slots (`slots`), sent
by the flusher (`sending`) -> pipelined XADD MAXLEN ~ (`wire`) -> WAIT per node on a Cluster
(`cluster_wait`)."""
