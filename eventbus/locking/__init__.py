"""The lock protocol's one client (`locks`), the Lua scripts (`scripts`), who a group member is
(`member`) and its lease with the one heartbeat loop (`lease`): used by consumers, the
offloader and catch-up alike."""
