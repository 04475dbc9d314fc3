"""Messages that cross process boundaries, and their msgpack codec."""
