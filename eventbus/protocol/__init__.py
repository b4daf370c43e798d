"""What another language must match to publish or consume alongside eventbus: key names
(`keys`), the shard function (`sharding`), the entry format (`codec`, `dictionaries`), topic
metadata (`topics`), retention (`retention`) and entry IDs (`ids`). docs/protocol.md is the
specification these modules implement."""
