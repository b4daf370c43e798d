"""`publish()`: `publisher` -> encode and check (`encoding`) -> ordered slots (`sending`) ->
pipelined XADD MAXLEN ~ (`wire`) -> WAIT per node on a Cluster (`cluster_wait`)."""
