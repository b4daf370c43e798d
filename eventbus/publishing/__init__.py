"""`publish()`: encode and check (`publisher`) -> ordered slots (`sending`) -> pipelined XADD
MAXLEN ~ (`wire`) -> WAIT per node on a Cluster (`cluster_wait`)."""
