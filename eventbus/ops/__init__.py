"""Operating a running bus: Prometheus metrics (`metrics`), the health and metrics endpoint
(`health`), logging configuration (`logs`) and instrumentation hooks (`hooks`)."""
