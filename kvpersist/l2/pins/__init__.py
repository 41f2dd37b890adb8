"""The warm set's pins: what they protect, how they are stored."""
