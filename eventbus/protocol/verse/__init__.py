"""The Verse wire profile: what a Python service must write and read to publish to, and consume
alongside, Ruby services built on Verse (verse-rb/verse-redis, its Redis Streams event manager).

`keys` (stream, lock and liveness key names), `sharding` (Verse's 32-bit linear-congruential
shard hash), `envelope` (the ``msg`` field: zlib of a MessagePack map ``{i, c, h, r}``); the lock
client for Verse's lock keys is `eventbus.locking.verse`. docs/verse.md is the specification
these modules implement, and says what eventbus guarantees in a fleet shared with Verse.
"""

from eventbus.protocol.verse.envelope import decode_verse, encode_verse
from eventbus.protocol.verse.keys import VerseKeys
from eventbus.protocol.verse.sharding import MAX_VERSE_SHARDS, verse_shard_of

__all__ = ["MAX_VERSE_SHARDS", "VerseKeys", "decode_verse", "encode_verse", "verse_shard_of"]
